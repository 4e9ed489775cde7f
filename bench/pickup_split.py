"""Pickup latency split along its path (issue 30): for each job, where the time from the
enqueueing transaction's start (`created_at`) to the claim's (`started_at`) went, for the raw
LISTEN/NOTIFY loop, a bare leasework worker (`Worker.run`, one process) and `leasework supervise`
(its defaults: 2 processes), in interleaved rounds. Jobs arrive one at a time with a pause
between, so each finds the listeners idle, as in bench/pickup_latency.py.

The points, each in wall-clock time on this host (the server's `now()` and Python's `time.time()`
read the same clock), relative to `created_at` (the enqueuer's BEGIN, as the server stamped it):

    enqueue sent      the enqueue's statement leaves the client (leasework: `Client._send` entered,
                      after the Python checks; raw: BEGIN returned, the INSERT sent)
    commit sent       the enqueue's statements returned (raw: the INSERT and the pg_notify), COMMIT
                      sent
    commit back       COMMIT returned to the enqueuer
    woke              the listener read the NOTIFY (leasework: `Wakeup._note`; raw: `notifies()`
                      yielded)
    poll              leasework only: `Worker.poll` entered after the wake-up
    claim sent        the claim's call begins (leasework: `lease.claim_runs` entered; raw: the
                      claim's `execute`)
    started_at        the claim's transaction start, as the server stamped it: the pickup latency

The leasework hooks are wrappers put around those functions in the listener processes (the
supervisor's children inherit them: the app module installs them before the fork); each costs a
`time.time()` call. Prints, per system, the median over rounds of each hop's per-round median
(ms), and the range over rounds. Asserts nothing.

    .venv/bin/python bench/pickup_split.py [--dsn DSN] [--samples 200] [--rounds 3]
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
from common import (
    DEFAULT_DSN,
    RAW_CLAIM,
    RAW_DONE,
    bench_database,
    drop_database,
    med,
    print_table,
    raw_drain,
    raw_table,
    spread,
    supervised,
)

from leasework import App, Config, db
from leasework.client import Client
from leasework.leases import lease
from leasework.workers.wakeup import Wakeup
from leasework.workers.worker import Worker

SPLIT_DIR = "LEASEWORK_SPLIT_DIR"


class _Marks:
    """The listener's marks for the claim it is about to send (one process, one main thread)."""

    woke: float | None = None
    poll: float | None = None
    out: Any = None
    pid = 0

    @classmethod
    def write(cls, line: str) -> None:
        if cls.out is None or cls.pid != os.getpid():  # opened after any fork
            cls.pid = os.getpid()
            path = Path(os.environ[SPLIT_DIR]) / f"split-{cls.pid}.tsv"
            cls.out = open(path, "a", buffering=1)  # noqa: SIM115 (kept for the process)
        cls.out.write(line)


def install_hooks() -> None:
    """Wrap the wake-up, the poll and the claim of a leasework worker with marks: in this
    process and in any forked from it. The marks of a claim are written after it returned."""
    note: Callable[[Wakeup, str], None] = Wakeup._note
    poll: Callable[..., int] = Worker.poll
    claim: Callable[..., list[lease.Claim]] = lease.claim_runs

    def marked_note(self: Wakeup, payload: str) -> None:
        if _Marks.woke is None:
            _Marks.woke = time.time()
        note(self, payload)

    def marked_poll(self: Worker, **kw: Any) -> int:
        _Marks.poll = time.time()
        return poll(self, **kw)

    def marked_claim(conn: Any, kinds: Any, **kw: Any) -> list[lease.Claim]:
        sent = time.time()
        woke, polled = _Marks.woke, _Marks.poll
        _Marks.woke = None
        claims = claim(conn, kinds, **kw)
        for c in claims:
            _Marks.write(f"{c.id}\t{woke}\t{polled}\t{sent}\n")
        return claims

    Wakeup._note = marked_note  # type: ignore[method-assign]
    Worker.poll = marked_poll  # type: ignore[method-assign]
    lease.claim_runs = marked_claim


def raw_listener(dsn: str) -> None:
    """bench/pickup_latency.py's raw listener with the marks: the first claim after a wake-up
    marked, the rest of the drain as raw_drain."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("LISTEN bench_raw")
        while True:
            woke = None
            for _ in conn.notifies(timeout=2.0, stop_after=1):
                woke = time.time()
                break
            sent = time.time()
            row = conn.execute(RAW_CLAIM, prepare=True).fetchone()
            if row is None:
                continue
            conn.execute(RAW_DONE, (row[0], row[1]), prepare=True)
            _Marks.write(f"{row[0]}\t{woke}\tNone\t{sent}\n")
            raw_drain(conn)


bench_app = App()


@bench_app.task("noop")
def noop(ctx: Any, payload: Any) -> None:
    return None


def lw_listener(dsn: str) -> None:
    install_hooks()
    cfg = Config(dsn=dsn)  # the defaults: 2 s poll, NOTIFY wake-up
    Worker(bench_app.with_config(cfg), cfg, register=False).run()


SUPERVISED_APP = """
import pickup_split
from leasework import App

pickup_split.install_hooks()
app = App()


@app.task("noop")
def noop(ctx, payload):
    return None
"""


@contextlib.contextmanager
def listening(admin_dsn: str, dsn: str, system: str, marks: Path) -> Iterator[None]:
    """The listener of `system` running, idle, until the block ends; its marks go to `marks`."""
    os.environ[SPLIT_DIR] = str(marks)
    if system == "supervise":
        with (
            tempfile.TemporaryDirectory() as tmp,
            psycopg.connect(admin_dsn, autocommit=True) as admin,
        ):
            (Path(tmp) / "pickup_app.py").write_text(SUPERVISED_APP)
            env = {SPLIT_DIR: str(marks)}
            with supervised(admin, dsn, Path(tmp), "pickup_app:app", 2, env=env):
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


# The hops printed: (label, from, to), each a mark's name; None is created_at.
HOPS = [
    ("created_at -> BEGIN back", None, "begun"),
    ("BEGIN back -> enqueue sent", "begun", "sent"),
    ("enqueue statement (round trip)", "sent", "commit"),
    ("COMMIT sent -> listener woke", "commit", "woke"),
    ("woke -> poll (leasework)", "woke", "poll"),
    ("poll -> claim sent (leasework)", "poll", "claim"),
    ("woke -> claim sent", "woke", "claim"),
    ("claim sent -> started_at", "claim", "started"),
    ("(COMMIT sent -> back to enqueuer)", "commit", "back"),
    ("pickup: created_at -> started_at", None, "started"),
]
# The pickup less the hop from COMMIT sent to the listener's wake-up (the commit's WAL flush and
# the NOTIFY's delivery: the server's and the kernel's, the same for every system, and the
# noisiest on a shared machine): what the enqueuer's and the listener's code decide.
OWN = "pickup less COMMIT -> woke"


def measure(admin_dsn: str, dsn: str, system: str, samples: int, gap: float) -> dict[str, float]:
    """One round of `system`: the median of each hop over its jobs (ms)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if system == "raw":
            raw_table(conn)
        else:
            db.migrate(conn)
            conn.execute("TRUNCATE leasework.runs, leasework.tenants, leasework.workers")
    sends: list[float] = []
    send: Callable[..., Any] = Client._send

    def marked_send(self: Client, c: Any, one: Any) -> Any:
        sends.append(time.time())
        return send(self, c, one)

    client: list[tuple[float, float, float]] = []  # (enqueue sent (raw), commit sent, back)
    with tempfile.TemporaryDirectory() as marks:
        with listening(admin_dsn, dsn, system, Path(marks)), psycopg.connect(
            dsn, autocommit=True
        ) as conn:
            Client._send = marked_send  # type: ignore[method-assign]
            try:
                for _ in range(samples):
                    tx = conn.transaction()
                    tx.__enter__()
                    begun = time.time()
                    if system == "raw":
                        conn.execute("INSERT INTO bench_raw_jobs DEFAULT VALUES")
                        conn.execute("SELECT pg_notify('bench_raw', '')")
                    else:
                        bench_app.enqueue(conn, "noop", {})
                    commit = time.time()
                    tx.__exit__(None, None, None)
                    client.append((begun, commit, time.time()))
                    time.sleep(gap)
            finally:
                Client._send = send  # type: ignore[method-assign]
            table = "bench_raw_jobs" if system == "raw" else "leasework.runs"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                row = conn.execute(
                    f"SELECT count(*) FROM {table} WHERE started_at IS NULL"
                ).fetchone()
                if row is not None and row[0] == 0:
                    break
                time.sleep(0.05)
            rows = conn.execute(
                f"SELECT id, extract(epoch FROM created_at), extract(epoch FROM started_at)"
                f" FROM {table} ORDER BY id"
            ).fetchall()
        listener: dict[int, tuple[float | None, ...]] = {}
        for path in Path(marks).glob("split-*.tsv"):
            for line in path.read_text().splitlines():
                run, *rest = line.split("\t")
                listener[int(run)] = tuple(None if v == "None" else float(v) for v in rest)
    hops: dict[str, list[float]] = {label: [] for label, _, _ in HOPS}
    for i, (run_id, created, started) in enumerate(rows):
        begun, commit, back = client[i]
        woke, polled, claim = listener.get(run_id, (None, None, None))
        at = {
            "begun": begun,
            "sent": sends[i] if system != "raw" else begun,
            "commit": commit,
            "back": back,
            "woke": woke,
            "poll": polled,
            "claim": claim,
            "started": float(started),
        }
        for label, a, b in HOPS:
            start = float(created) if a is None else at[a]
            end = at[b]
            if start is not None and end is not None:
                hops[label].append((end - start) * 1000)
        if woke is not None:
            own = (commit - float(created)) + (float(started) - woke)
            hops.setdefault(OWN, []).append(own * 1000)
    return {label: statistics.median(v) for label, v in hops.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gap", type=float, default=0.02, help="seconds between enqueues")
    ap.add_argument("--systems", default="raw,leasework,supervise")
    args = ap.parse_args()
    name = "leasework_bench_pickup_split"
    dsn = bench_database(args.dsn, name)
    systems = args.systems.split(",")
    res: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    try:
        for r in range(args.rounds):
            # Each round in another order: what runs after what shares the blame evenly.
            order = systems[r % len(systems) :] + systems[: r % len(systems)]
            for system in order:
                res[system].append(measure(args.dsn, dsn, system, args.samples, args.gap))
    finally:
        drop_database(args.dsn, name)
    print(f"pickup split: {args.samples} jobs one at a time, {args.rounds} interleaved rounds")
    print("(ms: median over rounds of each round's median, and the range of those)")
    headers = ["hop"]
    for s in systems:
        headers += [s, "range"]
    rows = []
    for label in [label for label, _, _ in HOPS] + [OWN]:
        row = [label]
        for s in systems:
            vals = [r[label] for r in res[s] if label in r]
            row += [f"{med(vals):.3f}", spread(vals, ".3f")] if vals else ["", ""]
        rows.append(row)
    print_table(headers, rows)


if __name__ == "__main__":
    main()
