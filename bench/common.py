"""Shared bits of the benchmark scripts: a private database per script, medians and ranges, and
one table format, and the results channel (`--results FILE`: one JSON object per figure, read by
bench/summary.py). Benchmarks print figures; none of them asserts a timing. Only the standard
library and psycopg here: bench/peers.py imports this in the peers' virtualenv."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


def bench_database(admin_dsn: str, name: str) -> str:
    """(Re)create database `name` on the server of `admin_dsn`; returns its DSN."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return psycopg.conninfo.make_conninfo(admin_dsn, dbname=name)


def drop_database(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def med(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float], fmt: str = ",.0f") -> str:
    return f"{format(min(values), fmt)}-{format(max(values), fmt)}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A plain-text table, first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    for j, row in enumerate([headers, *rows]):
        cells = [
            str(c).ljust(widths[i]) if i == 0 else str(c).rjust(widths[i])
            for i, c in enumerate(row)
        ]
        print("  ".join(cells).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def results_arg(ap: argparse.ArgumentParser) -> None:
    """--results FILE, default $LEASEWORK_BENCH_RESULTS (unset or empty: no results file)."""
    ap.add_argument(
        "--results",
        metavar="FILE",
        default=os.environ.get("LEASEWORK_BENCH_RESULTS") or None,
        help="append one JSON line per figure to FILE (default: $LEASEWORK_BENCH_RESULTS)",
    )


def record(
    results: str | None,
    target: int,
    label: str,
    value: float,
    unit: str,
    *,
    baseline: float | None = None,
    baseline_label: str = "",
    ratio: float | None = None,
    target_text: str = "",
    met: bool | None = None,
    notes: str = "",
    short: bool = False,
    issue: int = 7,
    skipped: str = "",
) -> None:
    """Append one figure to `results` (nothing when None). `target` is the target's number in
    `issue` (7: the performance set; 16: async handlers), `baseline` the raw loop's or the peer's
    figure from the same invocation, `met` None where no verdict applies, `short` True for a
    reduced size (--quick, or a short version of a target), `skipped` why a figure could not be
    measured here (then `value` is ignored)."""
    if not results:
        return
    row: dict[str, Any] = {
        "script": os.path.basename(sys.argv[0]),
        "target": target,
        "label": label,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "baseline_label": baseline_label,
        "ratio": ratio,
        "target_text": target_text,
        "met": met,
        "notes": notes,
        "short": short,
        "issue": issue,
    }
    if skipped:
        row["skipped"] = skipped
    with open(results, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")


# The raw queue: the ceiling leasework's figures are compared with, one table and the plainest
# loop on it (throughput.py, pickup_latency.py, bulk_enqueue.py, peers.py). Claim: the first
# queued row, FOR UPDATE SKIP LOCKED, a fresh owner token, a lease and the start time (as
# leasework's claim stamps them); finish: owner-scoped, one statement each, autocommit.
RAW_TABLE = "bench_raw_jobs"
RAW_SCHEMA = """
DROP TABLE IF EXISTS bench_raw_jobs;
CREATE TABLE bench_raw_jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    status text NOT NULL DEFAULT 'queued',
    payload jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    started_at timestamptz,
    lease_owner uuid,
    lease_expires_at timestamptz
);
CREATE INDEX ON bench_raw_jobs (id) WHERE status = 'queued';
"""
# The two-commit loop: claim, then finish, each its own statement and commit.
RAW_CLAIM = """
UPDATE bench_raw_jobs SET status = 'running', lease_owner = gen_random_uuid(),
       lease_expires_at = now() + interval '120 seconds', started_at = now()
 WHERE id = (SELECT id FROM bench_raw_jobs WHERE status = 'queued'
              ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id, lease_owner, payload
"""
RAW_DONE = "UPDATE bench_raw_jobs SET status = 'done' WHERE id = %s AND lease_owner = %s"
# The fused loop, the one-at-a-time limit: the finish of the previous job and the claim of the
# next in one statement, one commit per job (as leasework's finish_and_claim). The two parts touch
# different rows (the sealed one is running, the claimed one queued).
RAW_FUSED = """
WITH done AS (
    UPDATE bench_raw_jobs SET status = 'done'
     WHERE id = %(prev)s::bigint AND lease_owner = %(owner)s::uuid)
UPDATE bench_raw_jobs SET status = 'running', lease_owner = gen_random_uuid(),
       lease_expires_at = now() + interval '120 seconds', started_at = now()
 WHERE id = (SELECT id FROM bench_raw_jobs WHERE status = 'queued'
              ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id, lease_owner, payload
"""
# Batched: claim N in one statement, complete them in one (owner-scoped per row).
RAW_CLAIM_MANY = """
UPDATE bench_raw_jobs SET status = 'running', lease_owner = gen_random_uuid(),
       lease_expires_at = now() + interval '120 seconds', started_at = now()
 WHERE id = ANY(ARRAY(SELECT id FROM bench_raw_jobs WHERE status = 'queued'
                       ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED))
RETURNING id, lease_owner, payload
"""
RAW_DONE_MANY = """
UPDATE bench_raw_jobs j SET status = 'done'
  FROM unnest(%s::bigint[], %s::uuid[]) AS d(id, owner)
 WHERE j.id = d.id AND j.lease_owner = d.owner
"""
# Jobs the raw loops have not finished (peers.py checks every queue drained).
RAW_LEFT = "SELECT count(*) FROM bench_raw_jobs WHERE status <> 'done'"


def raw_table(conn: psycopg.Connection[Any]) -> None:
    """(Re)create the raw queue's table, empty."""
    conn.execute(RAW_SCHEMA)


def raw_setup(dsn: str, jobs: int, tenants: int = 0) -> None:
    """The raw table with `jobs` queued no-op rows, analyzed (`tenants` is ignored: the raw
    queue has none; the argument matches the other systems' set-up)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        raw_table(conn)
        conn.execute(
            "INSERT INTO bench_raw_jobs (payload) SELECT '{}' FROM generate_series(1, %s)", (jobs,)
        )
        conn.execute("VACUUM ANALYZE bench_raw_jobs")


def raw_drain(conn: psycopg.Connection[Any]) -> int:
    """Claim and finish queued rows one at a time until none is left; how many."""
    done = 0
    while (row := conn.execute(RAW_CLAIM, prepare=True).fetchone()) is not None:
        conn.execute(RAW_DONE, (row[0], row[1]), prepare=True)
        done += 1
    return done


def raw_fused_drain(conn: psycopg.Connection[Any]) -> int:
    """The fused loop: each statement finishes the previous job and claims the next, until one
    claims nothing; how many were finished."""
    done = 0
    params: dict[str, Any] = {"prev": None, "owner": None}
    while True:
        row = conn.execute(RAW_FUSED, params, prepare=True).fetchone()
        if params["prev"] is not None:
            done += 1
        if row is None:
            return done
        params = {"prev": row[0], "owner": row[1]}


def raw_worker(dsn: str) -> None:
    """The two-commit raw loop, one job at a time, until the queue is empty."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        raw_drain(conn)


def raw_fused_worker(dsn: str) -> None:
    """The fused raw loop (one statement and one commit per job) until the queue is empty."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        raw_fused_drain(conn)


def raw_batch_worker(batch: int, dsn: str) -> None:
    """The raw loop, `batch` jobs per claim and per finish, until the queue is empty."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            rows = conn.execute(RAW_CLAIM_MANY, (batch,), prepare=True).fetchall()
            if not rows:
                return
            conn.execute(RAW_DONE_MANY, ([r[0] for r in rows], [r[1] for r in rows]), prepare=True)


# -- what each job costs -------------------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    """Per job, over one timed run: commits (pg_stat_database.xact_commit of the bench database,
    read-only transactions included, so every autocommit statement counts), WAL bytes
    (pg_current_wal_lsn difference: the whole server's, so other databases' writes on a shared
    server count too), and CPU in microseconds: the worker processes' (getrusage of the reaped
    children) and their Postgres backends' (/proc, the server on this host only, else None)."""

    commits: float
    wal: float
    client_us: float
    backend_us: float | None


TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_ticks(pid: int) -> int | None:
    """utime + stime of a process, in clock ticks; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


class Backends:
    """Finds this host's Postgres backends connected to one database (their process title is
    `postgres: USER DBNAME HOST(PORT) STATE`). Each call reads the title of processes it has not
    classified yet only, so it can run every few milliseconds."""

    def __init__(self, dbname: str) -> None:
        self.marker = f" {dbname} ".encode()
        self._known: dict[int, bool] = {}  # pid -> is one of them

    def __call__(self) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            known = self._known.get(pid)
            if known is None:
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        title = f.read(200)
                except OSError:
                    continue
                if not title.startswith(b"postgres: ") and b"postgres" in title:
                    continue  # a backend just forked, not titled yet: look again next time
                known = self._known[pid] = title.startswith(b"postgres: ") and self.marker in title
            if known:
                found.append(pid)
        return found


class Meter:
    """Measures a Cost around one timed run: `start()` after the queue is filled, `stop(jobs)`
    after every worker process has exited. A thread reads the bench database's backends' CPU
    from /proc every 20 ms while the run lasts (each backend's last reading counts: at most
    20 ms of a backend's time is missed when it exits)."""

    def __init__(self, dsn: str) -> None:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
        self.dsn = dsn
        self.dbname = str(info.get("dbname") or "")
        host = str(info.get("host") or "localhost")
        self.local = host in ("localhost", "127.0.0.1", "::1") or host.startswith("/")
        self._ticks: dict[int, tuple[int, int]] = {}  # pid -> (first reading, last reading)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._probe_pid = 0
        self._ignored: set[int] = set()  # the bench's own sessions (a watcher), not a worker's
        self._backends = Backends(self.dbname)

    def ignore(self, pid: int) -> None:
        """Leave out the backend `pid` (a session of the bench itself) from the backend CPU."""
        self._ignored.add(pid)

    def _read(self) -> tuple[int, int]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            self._probe_pid = conn.info.backend_pid
            row = conn.execute(
                "SELECT xact_commit, pg_current_wal_lsn() - '0/0'::pg_lsn"
                "  FROM pg_stat_database WHERE datname = current_database()"
            ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def _sample(self) -> None:
        for pid in self._backends():
            if pid == self._probe_pid or pid in self._ignored:
                continue
            ticks = _proc_ticks(pid)
            if ticks is not None:
                first = self._ticks.get(pid, (ticks, ticks))[0]
                self._ticks[pid] = (first, ticks)

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            self._sample()

    def start(self) -> None:
        self._commits, self._wal = self._read()
        self._rusage = resource.getrusage(resource.RUSAGE_CHILDREN)
        if self.local:
            self._sample()  # backends left from the set-up count from here
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()

    def stop(self, jobs: int) -> Cost:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        client = (ru.ru_utime + ru.ru_stime) - (self._rusage.ru_utime + self._rusage.ru_stime)
        backend: float | None = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()
            backend = sum(last - first for first, last in self._ticks.values()) / TICK
        # A backend flushes its statistics when it exits: wait for the workers' to be gone.
        deadline = time.monotonic() + 5
        while self.local and time.monotonic() < deadline:
            if not [p for p in self._backends() if p != self._probe_pid]:
                break
            time.sleep(0.05)
        commits, wal = self._read()
        per = max(jobs, 1)
        return Cost(
            commits=(commits - self._commits - 1) / per,  # less the first reading's own
            wal=(wal - self._wal) / per,
            client_us=client * 1e6 / per,
            backend_us=None if backend is None else backend * 1e6 / per,
        )


@dataclass(frozen=True)
class Run:
    """One timed run: jobs per second and what each job cost."""

    rate: float
    cost: Cost


def rounds(labels: Sequence[str], repeat: int, one: Callable[[str], Run]) -> dict[str, list[Run]]:
    """`repeat` rounds of one run per label, the order reversed every other round (A B C, C B
    A, ...): a machine whose speed drifts during the invocation favours no label, and labels
    next to each other in `labels` run back to back in every round, so a ratio between the two
    is measured under the same conditions (`paired`)."""
    results: dict[str, list[Run]] = {label: [] for label in labels}
    for i in range(repeat):
        for label in labels if i % 2 == 0 else reversed(labels):
            results[label].append(one(label))
    return results


def paired(runs: Sequence[Run], baseline: Sequence[Run]) -> float:
    """The median over rounds of each round's throughput ratio (the runs of one round ran back to
    back): less moved by the machine's drift than the ratio of the two medians, which pairs runs
    made minutes apart."""
    return med([r.rate / b.rate for r, b in zip(runs, baseline, strict=True)])


def cost_cells(runs: Sequence[Run]) -> list[str]:
    """Median per-job costs of some runs: commits, WAL bytes, client and backend CPU (µs)."""
    backend = [r.cost.backend_us for r in runs if r.cost.backend_us is not None]
    return [
        f"{med([r.cost.commits for r in runs]):.2f}",
        f"{med([r.cost.wal for r in runs]):,.0f}",
        f"{med([r.cost.client_us for r in runs]):,.0f}",
        f"{med(backend):,.0f}" if backend else "n/a",
    ]


COST_HEADERS = ["commits/job", "WAL B/job", "client µs/job", "backend µs/job"]


# -- `leasework supervise`, as users deploy it -----------------------------------------------


@contextlib.contextmanager
def supervised(
    admin: psycopg.Connection[Any],
    dsn: str,
    tmp: Path,
    app: str,
    processes: int,
    pools: Sequence[str] = (),
    log_level: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """`leasework supervise --app APP --dsn DSN` with its defaults (and `pools`; `log_level`
    through LEASEWORK_LOG_LEVEL), run in `tmp` (where APP's module is), until its children's
    control sessions are open (`processes` of them); SIGTERM and waited for on exit. Its log goes
    to tmp/supervise.log, as to a file or journald (a log line costs what it costs deployed)."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), *sys.path]), **(env or {})}
    environ.pop("LEASEWORK_CONFIG", None)
    if log_level:
        environ["LEASEWORK_LOG_LEVEL"] = log_level
    command = [sys.executable, "-m", "leasework", "supervise", "--app", app, "--dsn", dsn]
    for spec in pools:
        command += ["--pool", spec]
    with open(tmp / "supervise.log", "ab") as log_file:
        sup = subprocess.Popen(
            command, cwd=tmp, env=environ, stdout=subprocess.DEVNULL, stderr=log_file
        )
    try:
        name = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
        deadline = time.monotonic() + 60
        while control_sessions(admin, name) < processes:
            if sup.poll() is not None:
                raise RuntimeError(f"leasework supervise exited {sup.returncode} at start-up")
            if time.monotonic() > deadline:
                raise RuntimeError("the supervisor's children did not start within 60 s")
            time.sleep(0.2)  # polling the boot
        yield sup
    finally:
        sup.send_signal(signal.SIGTERM)
        try:
            sup.wait(60)
        except subprocess.TimeoutExpired:
            sup.kill()
            sup.wait()


def control_sessions(admin: psycopg.Connection[Any], name: str) -> int:
    """leasework control sessions open on database `name` (one per worker process)."""
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
        " AND application_name LIKE 'leasework:%%:control'",
        (name,),
    ).fetchone()
    return int(row[0]) if row else 0
