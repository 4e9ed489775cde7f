"""The scaling curve (docs/scaling.md): 1 to 64 worker processes spread over 4 hosts, each host a
network namespace running a real `leasework supervise --processes K` that reaches one Postgres
over its veth link (tests/faults/netns.py), directly and through PgBouncer in transaction mode
(tests/pgbouncer.py, the hosts' LISTEN direct over `listen_dsn`). Processes are spread as evenly
as the 4 hosts allow (3 processes: 1+1+1+0).

Postgres is a private cluster with Postgres' own durability defaults (fsync and full-page writes
on, synchronous commit), pg_stat_statements loaded, listening on the hosts' links. For each
process count and route, after a warm-up:

- drain: --jobs no-op runs enqueued in one transaction (the workers wake on its NOTIFY), plus a
  stream of single enqueues with priority -1, one at a time, 100 ms apart (they overtake the
  backlog: the pickup latency of a busy fleet, enqueue to claim in database time,
  `started_at - created_at`). Throughput: the runs sealed by the time the bulk's last one was,
  over the database time from the first claim;
- idle: --samples single enqueues, each once the previous one has run and 50-70 ms later: the
  pickup latency of an idle fleet, which every NOTIFY wakes whole.

Beside each: the most sessions the bench database had at once (pg_stat_activity, sampled every
100 ms, by role, the bench's own left out), CPU in seconds (the whole Postgres cluster, every server
process; the supervisors and their children; PgBouncer; read from /proc as utime + stime of the
process and of its children, live or reaped: exact, no sampling), the machine's busy share
(/proc/stat: other people's processes count too), and the claims that came back empty:
pg_stat_statements' calls of the two statements that claim (`claim_runs`, and `finish_and_claim`,
the seal riding on the next claim) less the runs claimed. Nothing in leasework counts those; the
engine is measured as it ships.

Needs root (network namespaces), iproute2, initdb/pg_ctl and pgbouncer; says which is missing.
Prints a table; asserts nothing.

    .venv/bin/python bench/scale.py [--quick] [--procs 1,2,4] [--routes direct,pgbouncer]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from common import print_table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from leasework import App, db
from tests.faults import netns
from tests.pgbouncer import Bouncer, executable, pgbouncer
from tests.pgcluster import Cluster, private_cluster

DBNAME = "leasework_scale"
BENCH_APP = "leasework-bench-scale"  # application_name of the bench's own sessions
HOSTS = 4
APP = textwrap.dedent(
    """
    from leasework import App

    app = App()


    @app.task("noop")
    def noop(ctx, payload):
        return None
    """
)
# Postgres' own defaults for durability (tests/pgcluster.py turns fsync and full-page writes off
# for speed), room for 64 processes direct, and the statement counter for the empty claims.
SETTINGS = (
    "fsync=on",
    "full_page_writes=on",
    "max_connections=300",
    "shared_preload_libraries=pg_stat_statements",
    "pg_stat_statements.max=1000",
)
TICK = os.sysconf("SC_CLK_TCK")
enqueuer = App()
enqueuer.task("noop")(lambda ctx, payload: None)


# -- CPU from /proc --------------------------------------------------------------------------------


def own_ticks(pid: int) -> int:
    """utime + stime of the process itself (not its children); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def tree_ticks(pid: int) -> int:
    """CPU of a process and all its descendants, live or reaped, in clock ticks: its utime +
    stime, plus cutime + cstime (the children it has reaped), plus each live child's own. A
    process that is gone counts 0 (its parent's cutime holds it once reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return 0
    own = sum(int(fields[i]) for i in (11, 12, 13, 14))
    return own + sum(tree_ticks(int(k)) for k in kids)


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, every CPU (/proc/stat)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


@dataclass
class Cpu:
    """CPU seconds over a phase, and its wall time."""

    postgres: float  # the whole cluster: postmaster, backends, WAL writer, checkpointer, ...
    children: float  # the worker processes (the supervisors' children)
    parents: float  # the supervisors themselves
    pooler: float
    bench: float  # this script: the enqueues and the sampling
    busy: float  # the machine's busy share, every process on it, 0..1
    wall: float


class CpuMeter:
    def __init__(self, postmaster: int, supervisors: Sequence[int], pooler: int | None) -> None:
        self.pids = (postmaster, list(supervisors), pooler)

    def read(self) -> tuple[int, int, int, int, float, tuple[int, int], float]:
        pm, sups, pooler = self.pids
        me = os.times()
        parents = sum(own_ticks(p) for p in sups)
        return (
            tree_ticks(pm),
            sum(tree_ticks(p) for p in sups) - parents,
            parents,
            tree_ticks(pooler) if pooler else 0,
            me.user + me.system,
            machine_ticks(),
            time.monotonic(),
        )

    def start(self) -> None:
        self._start = self.read()

    def stop(self) -> Cpu:
        a, b = self._start, self.read()
        return Cpu(
            postgres=(b[0] - a[0]) / TICK,
            children=(b[1] - a[1]) / TICK,
            parents=(b[2] - a[2]) / TICK,
            pooler=(b[3] - a[3]) / TICK,
            bench=b[4] - a[4],
            busy=(b[5][0] - a[5][0]) / max(b[5][1] - a[5][1], 1),
            wall=b[6] - a[6],
        )


# -- sessions and statements ----------------------------------------------------------------------


def role(application_name: str) -> str:
    """A session's role from its application_name (leasework:<worker>:control, :keeper, :listen;
    leasework:supervisor and leasework:supervisor:listen; the pool's are plain `leasework:<worker>`).
    Behind PgBouncer a server session carries the name of whichever client used it last."""
    if application_name.startswith("leasework:supervisor"):
        return "listen" if application_name.endswith(":listen") else "supervisor"
    if application_name.startswith("leasework:"):
        return application_name.rsplit(":", 1)[-1] if application_name.count(":") == 2 else "pool"
    return application_name or "unnamed"


class Sessions(threading.Thread):
    """The most client sessions the bench database had at once, sampled every 100 ms, and that
    sample's sessions by role."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.most: dict[str, int] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True, application_name=BENCH_APP) as conn:
            while not self.halt.is_set():
                rows = conn.execute(
                    "SELECT application_name, client_addr <> '127.0.0.1' FROM pg_stat_activity"
                    " WHERE datname = current_database() AND backend_type = 'client backend'"
                    " AND application_name <> %s",
                    (BENCH_APP,),
                ).fetchall()
                if len(rows) > sum(self.most.values()):
                    counts: dict[str, int] = {}
                    for name, from_host in rows:
                        # Through PgBouncer every session but the direct LISTEN comes from it.
                        key = role(name or "") if from_host else "via pooler"
                        counts[key] = counts.get(key, 0) + 1
                    self.most = counts
                self.halt.wait(0.1)

    def stop(self) -> dict[str, int]:
        self.halt.set()
        self.join()
        return self.most


def claim_calls(conn: psycopg.Connection[Any]) -> int:
    """Calls since the last reset of the statements that claim: claim_runs on its own and inside
    finish_and_claim (both, and only they, hold the claim's `untenanted_queued` branch)."""
    row = conn.execute(
        "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements"
        " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " AND query LIKE '%%untenanted_queued%%'"
    ).fetchone()
    return int(row[0]) if row else 0


# -- hosts -----------------------------------------------------------------------------------------


def spread_over(procs: int, hosts: int) -> list[int]:
    """`procs` processes over `hosts` hosts as evenly as possible (the first get the extra)."""
    return [procs // hosts + (1 if i < procs % hosts else 0) for i in range(hosts)]


@dataclass
class Route:
    name: str
    cluster: Cluster
    bouncer: Bouncer | None

    def dsn(self, host: netns.Host) -> str:
        """What `host`'s supervisor connects to: Postgres, or the pooler, over its link."""
        port = self.bouncer.port if self.bouncer else self.cluster.port
        return f"postgresql://postgres@{host.server_addr}:{port}/{DBNAME}"

    def direct(self, host: netns.Host) -> str:
        return f"postgresql://postgres@{host.server_addr}:{self.cluster.port}/{DBNAME}"


@contextlib.contextmanager
def fleet(
    route: Route, hosts: Sequence[netns.Host], procs: int, tmp: Path
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One `leasework supervise` per host that gets processes; SIGTERM on exit, then waited for."""
    sups: list[subprocess.Popen[bytes]] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEWORK_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), *sys.path])
    try:
        for host, k in zip(hosts, spread_over(procs, len(hosts)), strict=True):
            if k == 0:
                continue
            home = tmp / host.name
            home.mkdir(exist_ok=True)
            host_env = dict(env)
            if route.bouncer:  # NOTIFY over one direct connection per host, relayed
                host_env["LEASEWORK_LISTEN_DSN"] = route.direct(host)
            with open(home / f"supervisor-{route.name}-{procs}.log", "ab") as log:
                sups.append(
                    subprocess.Popen(
                        [*host.wrap, sys.executable, "-m", "leasework", "supervise",
                         "--app", "scaleapp:app", "--processes", str(k),
                         "--dsn", route.dsn(host)],
                        cwd=home, env=host_env, stdout=log, stderr=subprocess.STDOUT,
                    )
                )  # fmt: skip
        yield sups
    finally:
        for sup in sups:
            with contextlib.suppress(ProcessLookupError):
                sup.send_signal(signal.SIGTERM)
        for sup in sups:
            try:
                sup.wait(60)
            except subprocess.TimeoutExpired:
                sup.kill()
                sup.wait(10)


def wait_until(
    what: str,
    check: Any,
    timeout: float,
    sups: Sequence[subprocess.Popen[bytes]],
    every: float = 0.05,
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        dead = [s.args for s in sups if s.poll() is not None]
        if dead:
            raise SystemExit(f"scale.py: a supervisor exited while waiting for {what}: {dead}")
        if time.monotonic() > deadline:
            raise SystemExit(f"scale.py: {what} did not happen within {timeout:g} s")
        time.sleep(every)  # polling a condition


# -- one point -------------------------------------------------------------------------------------


@dataclass
class Phase:
    jobs: int
    rate: float  # jobs per second of database time, first claim to last seal
    p50_ms: float
    p95_ms: float
    sessions: dict[str, int]  # the busiest sample, by role
    empty: int
    cpu: Cpu
    load: float  # the machine's 1-minute load average at the end

    def per_job(self, seconds: float) -> str:
        """CPU seconds as µs per run."""
        return f"{seconds * 1e6 / max(self.jobs, 1):,.0f}"


def pending(conn: psycopg.Connection[Any], marker: int, upto: int = 2**62) -> bool:
    """Whether a run after `marker` (up to `upto`) is still queued or running: two look-ups in
    the partial indexes of queued and of running runs (this is polled while figures are taken)."""
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM leasework.runs WHERE status = 'queued'"
        "                  AND id > %(m)s AND id <= %(u)s)"
        " OR EXISTS (SELECT 1 FROM leasework.runs WHERE status = 'running'"
        "              AND id > %(m)s AND id <= %(u)s)",
        {"m": marker, "u": upto},
    ).fetchone()
    return bool(row and row[0])


def started(conn: psycopg.Connection[Any], run: int) -> bool:
    row = conn.execute("SELECT started_at IS NOT NULL FROM leasework.runs WHERE id = %s", (run,))
    found = row.fetchone()
    return bool(found and found[0])


def done(conn: psycopg.Connection[Any], marker: int) -> bool:
    return not pending(conn, marker)


def last_id(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT coalesce(max(id), 0) FROM leasework.runs").fetchone()
    return int(row[0]) if row else 0


def latencies(conn: psycopg.Connection[Any], ids: Sequence[int]) -> list[float]:
    rows = conn.execute(
        "SELECT extract(epoch FROM started_at - created_at) * 1000 FROM leasework.runs"
        " WHERE id = ANY(%s)",
        (list(ids),),
    ).fetchall()
    return [float(r[0]) for r in rows]


def p(values: Sequence[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def measure(
    conn: psycopg.Connection[Any], dsn: str, meter: CpuMeter, marker: int, body: Any
) -> tuple[list[int], Cpu, dict[str, int], int]:
    """Run `body()` (which returns the timed runs' ids) between the readings: CPU, sessions and
    claim calls; returns the ids, the CPU, the most sessions (by role) and the empty claims."""
    conn.execute("SELECT pg_stat_statements_reset()")
    sessions = Sessions(dsn)
    sessions.start()
    meter.start()
    ids = body()
    cpu = meter.stop()
    most = sessions.stop()
    calls = claim_calls(conn)
    row = conn.execute(
        "SELECT count(*) FROM leasework.runs WHERE id > %s AND started_at IS NOT NULL", (marker,)
    ).fetchone()
    claimed = int(row[0]) if row else 0
    return ids, cpu, most, calls - claimed


def drain(conn: psycopg.Connection[Any], dsn: str, meter: CpuMeter, jobs: int, sups: Any) -> Phase:
    marker = last_id(conn)
    timed: list[int] = []
    bulk: list[int] = []  # the last id of the bulk enqueue
    halt = threading.Event()

    def stream() -> None:
        # One timed run at a time, every 100 ms at most: a few percent of the load at the
        # slowest point, so the stream does not become the work it samples.
        with psycopg.connect(dsn, autocommit=True, application_name=BENCH_APP) as c:
            while not halt.wait(0.1):
                if timed and not started(c, timed[-1]):
                    continue
                timed.append(enqueuer.enqueue(c, "noop", {}, priority=-1))

    def body() -> list[int]:
        with conn.transaction():
            bulk.append(last := max(enqueuer.enqueue_many(conn, "noop", [{}] * jobs)))
        t = threading.Thread(target=stream, daemon=True)
        t.start()
        try:
            # Until the bulk is done (the stream keeps adding runs after it), then the stream's.
            drained = lambda: not pending(conn, marker, last)  # noqa: E731
            wait_until("the drain", drained, 900, sups, every=0.2)
        finally:
            halt.set()
            t.join()
        wait_until("the last timed run", lambda: done(conn, marker), 60, sups)
        return timed

    ids, cpu, most, empty = measure(conn, dsn, meter, marker, body)
    # The runs sealed by the time the bulk's last one was, over the time from the first claim.
    row = conn.execute(
        "WITH b AS (SELECT max(finished_at) AS t FROM leasework.runs"
        "            WHERE id > %(m)s AND id <= %(u)s)"
        " SELECT count(*) FILTER (WHERE finished_at <= b.t),"
        "        extract(epoch FROM b.t - min(started_at))"
        "   FROM leasework.runs, b WHERE id > %(m)s GROUP BY b.t",
        {"m": marker, "u": bulk[0]},
    ).fetchone()
    assert row is not None
    n, seconds = int(row[0]), float(row[1])
    lat = latencies(conn, ids)
    return Phase(n, n / seconds, p(lat, 50), p(lat, 95), most, empty, cpu, load1())


def trickle(
    conn: psycopg.Connection[Any], dsn: str, meter: CpuMeter, samples: int, sups: Any
) -> Phase:
    marker = last_id(conn)

    def body() -> list[int]:
        ids = []
        for _ in range(samples):
            run = enqueuer.enqueue(conn, "noop", {})
            ids.append(run)
            wait_until("an idle pickup", lambda: done(conn, marker), 60, sups)
            time.sleep(0.05 + random.uniform(0, 0.02))  # a pause: the next finds the fleet idle
        return ids

    ids, cpu, most, empty = measure(conn, dsn, meter, marker, body)
    lat = latencies(conn, ids)
    return Phase(len(ids), float("nan"), p(lat, 50), p(lat, 95), most, empty, cpu, load1())


@dataclass
class Point:
    route: str
    procs: int
    busy: Phase
    idle: Phase


def point(
    route: Route, hosts: Sequence[netns.Host], procs: int, tmp: Path, jobs: int, samples: int
) -> Point:
    dsn = psycopg.conninfo.make_conninfo(route.cluster.dsn, dbname=DBNAME)
    with (
        psycopg.connect(dsn, autocommit=True, application_name=BENCH_APP) as conn,
        fleet(route, hosts, procs, tmp) as sups,
    ):
        since = conn.execute("SELECT now()").fetchone()
        assert since is not None

        def up() -> bool:
            row = conn.execute(
                "SELECT count(*) FROM leasework.workers WHERE started_at >= %s"
                " AND stopped_at IS NULL",
                (since[0],),
            ).fetchone()
            return row is not None and int(row[0]) >= procs

        wait_until(f"{procs} workers", up, 120, sups)
        # Warm-up: every child has connected, prepared its statements and is idle again.
        marker = last_id(conn)
        with conn.transaction():
            enqueuer.enqueue_many(conn, "noop", [{}] * max(procs * 3, 50))
        wait_until("the warm-up", lambda: done(conn, marker), 120, sups)
        time.sleep(1.0)  # the warm-up's last idle polls settle
        pm = route.cluster.postmaster()
        assert pm is not None
        pooler = route.bouncer.proc.pid if route.bouncer and route.bouncer.proc else None
        meter = CpuMeter(pm, [s.pid for s in sups], pooler)
        busy = drain(conn, dsn, meter, jobs, sups)
        idle = trickle(conn, dsn, meter, samples, sups)
        for status, n in conn.execute(
            "SELECT status, count(*) FROM leasework.runs WHERE status <> 'succeeded' GROUP BY 1"
        ).fetchall():
            print(f"scale.py: {n} runs {status} at {procs} processes ({route.name})", flush=True)
        conn.execute("TRUNCATE leasework.runs")  # the next point starts from an empty table
    return Point(route.name, procs, busy, idle)


# -- report ----------------------------------------------------------------------------------------


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def report(points: Sequence[Point]) -> None:
    rows = []
    for pt in points:
        b, i = pt.busy, pt.idle
        c = b.cpu
        rows.append(
            [
                pt.route,
                str(pt.procs),
                f"{b.rate:,.0f}",
                f"{b.p95_ms:.1f}",
                f"{i.p95_ms:.1f}",
                str(sum(b.sessions.values())),
                str(sum(i.sessions.values())),
                f"{b.empty / b.jobs:.2f}",
                f"{i.empty / i.jobs:.1f}",
                f"{c.postgres / c.wall:.2f}",
                f"{(c.postgres + c.children + c.parents + c.pooler) / c.wall:.2f}",
                b.per_job(c.postgres),
                b.per_job(c.children),
                b.per_job(c.parents),
                b.per_job(c.pooler) if pt.route != "direct" else "-",
                f"{c.busy * 100:.0f}%",
                f"{b.load:.1f}",
            ]
        )
    print_table(
        ["route", "procs", "jobs/s", "p95 busy ms", "p95 idle ms", "sessions", "idle sessions",
         "empty/run", "empty/idle run", "PG cores", "fleet cores", "PG µs/run",
         "children µs/run", "supervisors µs/run", "pooler µs/run", "machine busy", "load"],
        rows,
    )  # fmt: skip
    print()
    print(
        "jobs/s: runs / database time from the first claim to the last seal; p95: enqueue to "
        "claim in database time, of single runs enqueued with priority -1 during the drain (busy) "
        "and one at a time into an idle fleet (idle); sessions: the most the bench database had "
        "at once during the drain, and during the idle pickups (the bench's own left out; through "
        "PgBouncer: the pooler's server sessions and each host's direct LISTEN); empty: claim "
        "statements that claimed nothing (pg_stat_statements), per run drained and per idle "
        "pickup; PG cores: the whole cluster's CPU seconds per second of the drain; fleet cores: "
        "Postgres', the workers' and the pooler's together (the rest of the machine's busy share "
        "is other processes'); µs/run: CPU per run drained (children: the worker processes; "
        "supervisors: the parents); machine busy and load: every process on the machine, other "
        "people's included."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1, 4, 16 and 64 processes, fewer runs")
    ap.add_argument("--procs", help="comma-separated process counts (default 1,2,4,8,16,32,64)")
    ap.add_argument("--routes", default="direct,pgbouncer", help="direct, pgbouncer or both")
    ap.add_argument("--jobs", type=int, help="runs drained per point (default 4000; quick 1500)")
    ap.add_argument("--samples", type=int, help="idle pickups per point (default 40; quick 15)")
    ap.add_argument("--pool-size", type=int, default=20, help="PgBouncer's default_pool_size")
    args = ap.parse_args()
    try:
        procs = [
            int(v)
            for v in (args.procs or ("1,4,16,64" if args.quick else "1,2,4,8,16,32,64")).split(",")
        ]
    except ValueError:
        raise SystemExit(
            f"scale.py: --procs must be comma-separated integers, got {args.procs!r}"
        ) from None
    if not procs or min(procs) < 1:
        raise SystemExit(f"scale.py: --procs must be positive integers, got {args.procs!r}")
    routes = args.routes.split(",")
    if not routes or set(routes) - {"direct", "pgbouncer"}:
        raise SystemExit(
            f"scale.py: --routes must be direct, pgbouncer or both, got {args.routes!r}"
        )
    jobs = (1500 if args.quick else 4000) if args.jobs is None else args.jobs
    samples = (15 if args.quick else 40) if args.samples is None else args.samples
    for flag, value in (("--jobs", jobs), ("--samples", samples), ("--pool-size", args.pool_size)):
        if value < 1:
            raise SystemExit(f"scale.py: {flag} must be a positive integer, got {value}")
    # SIGTERM (a timeout, a stopped `make`) unwinds like Ctrl-C: the supervisors are stopped and
    # the namespaces, PgBouncer and the cluster removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    reason = netns.unavailable()
    if reason:
        raise SystemExit(f"scale.py: {reason}")
    if "pgbouncer" in routes and executable() is None:
        raise SystemExit("scale.py: pgbouncer is not installed (Debian: apt-get install pgbouncer)")

    print(f"load average before: {load()} ({os.cpu_count()} CPUs)", flush=True)
    points: list[Point] = []
    with (
        netns.hosts(HOSTS) as hosts,
        private_cluster(
            "leasework-scale-",
            listen=[h.server_addr for h in hosts],
            hba=[h.subnet for h in hosts],
            settings=SETTINGS,
        ) as cluster,
        contextlib.ExitStack() as stack,
        tempfile.TemporaryDirectory() as tmpdir,
    ):
        tmp = Path(tmpdir)
        tmp.chmod(0o755)
        (tmp / "scaleapp.py").write_text(APP)
        with psycopg.connect(cluster.dsn, autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {DBNAME}")
        dsn = psycopg.conninfo.make_conninfo(cluster.dsn, dbname=DBNAME)
        with psycopg.connect(dsn, autocommit=True) as conn:
            db.migrate(conn)
            conn.execute("CREATE EXTENSION pg_stat_statements")
        bouncer = None
        if "pgbouncer" in routes:
            bouncer = stack.enter_context(
                pgbouncer(
                    cluster.dsn, pool_size=args.pool_size, listen=[h.server_addr for h in hosts]
                )
            )
        by_name = {
            "direct": Route("direct", cluster, None),
            "pgbouncer": Route("pgbouncer", cluster, bouncer),
        }
        for n, count in enumerate(procs):
            # Interleaved: the route that goes first alternates from one count to the next.
            for name in routes if n % 2 == 0 else routes[::-1]:
                if bouncer:  # the pooler's idle server sessions from the last point: closed
                    bouncer.admin(f"RECONNECT {DBNAME}")
                pt = point(by_name[name], hosts, count, tmp, jobs, samples)
                points.append(pt)
                print(
                    f"{name:9} {count:3} processes: {pt.busy.rate:,.0f} jobs/s,"
                    f" p95 busy {pt.busy.p95_ms:.1f} ms, idle {pt.idle.p95_ms:.1f} ms,"
                    f" sessions {pt.busy.sessions}, idle {pt.idle.sessions} (load {load()})",
                    flush=True,
                )
    print()
    print(
        f"{HOSTS} hosts (network namespaces), one Postgres 15 (private cluster: fsync on,"
        f" synchronous commit), PgBouncer transaction mode, default_pool_size {args.pool_size};"
        f" {jobs:,} no-op runs drained and {samples} idle pickups per point"
    )
    points.sort(key=lambda pt: (routes.index(pt.route), pt.procs))
    report(points)
    print(f"load average after: {load()}")


if __name__ == "__main__":
    main()
