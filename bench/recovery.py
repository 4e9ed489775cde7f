"""Recovery after kill -9 (issue 7, target 6), and each worker child's memory at rest (target 7).

Median time from `kill -9` of the worker process holding a run to another worker claiming it,
measured in database time (the new attempt's `started_at` minus the server's clock read right
after the kill), two ways side by side:

- supervised: `leasework supervise --processes 2`; the parent reaps the child, expires its
  leases at once and wakes the idle workers (the fast release);
- lease expiry: two standalone `leasework worker` processes, nobody to release the dead one's
  lease, so the run waits out the lease (renewed every third, so 2/3 to all of it remains) plus
  up to a poll.

Default seed timings (poll 2 s) with a lease shortened to --lease seconds (default 12) so the
second column takes seconds, not minutes per kill. Also prints each supervised child's RSS and
PSS at rest (idle, after its first poll). Asserts nothing.

    .venv/bin/python bench/recovery.py [--dsn DSN] [--repeat 5] [--lease 12] [--quick]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from common import (
    DEFAULT_DSN,
    bench_database,
    drop_database,
    med,
    print_table,
    record,
    results_arg,
    spread,
)

from leasework import db

APP = textwrap.dedent(
    """
    import time
    from leasework import App

    app = App()


    @app.task("hold", max_attempts=100)
    def hold(ctx, payload):
        # The first attempt holds its run until it is killed; the one that reclaims it finishes.
        while ctx.attempt == 1:
            ctx.check()
            time.sleep(0.01)
        return None
    """
)

Conn = psycopg.Connection[Any]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.005)


def pid_of(worker_id: str) -> int:
    return int(worker_id.rsplit("-", 2)[1])


def memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in KiB: RSS counts pages shared with the parent after fork, PSS splits them."""
    rss = pss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
    return rss, pss


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(p) for p in text.split()]


class Harness:
    def __init__(self, dsn: str, tmp: Path, lease: float) -> None:
        self.dsn = dsn
        self.tmp = tmp
        (tmp / "recovery_app.py").write_text(APP)
        config = {
            "lease": lease,
            "renew_interval": lease / 3,
            "control_interval": min(2.0, lease / 6),
            "heartbeat_interval": 1.0,
            "hang_timeout": lease * 10,
            "watchdog_margin": lease / 6,
            "restart_backoff": 0.1,
        }
        self.config = tmp / "leasework.toml"
        self.config.write_text("".join(f"{k} = {v}\n" for k, v in config.items()))
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), *sys.path])}
        self.env.pop("LEASEWORK_CONFIG", None)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.common = ["--app", "recovery_app:app", "--config", str(self.config), "--dsn", dsn]

    def start(self, *command: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "leasework", *command, *self.common],
            cwd=self.tmp,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()

    def one_kill(self, conn: Conn) -> float:
        """Enqueue a holding run, kill -9 its holder, return seconds until it is claimed again."""
        run_id = conn.execute(
            "INSERT INTO leasework.runs (kind, payload, max_attempts) VALUES ('hold', '{}', 100)"
            " RETURNING id"
        ).fetchone()[0]  # type: ignore[index]
        conn.execute(f"NOTIFY {db.NOTIFY_CHANNEL}, 'hold'")

        def holder() -> str | None:
            row = conn.execute(
                "SELECT lease_worker FROM leasework.runs WHERE id = %s AND attempts = 1"
                " AND status = 'running'",
                (run_id,),
            ).fetchone()
            return row[0] if row and row[0] else None

        worker = wait_for(holder, 30, "the run to be claimed")
        time.sleep(0.3)  # let it settle into its loop (not a measurement)
        os.kill(pid_of(worker), signal.SIGKILL)
        killed = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]

        def reclaimed() -> Any:
            row = conn.execute(
                "SELECT started_at FROM leasework.runs WHERE id = %s AND attempts >= 2",
                (run_id,),
            ).fetchone()
            return row[0] if row else None

        started = wait_for(reclaimed, 300, "the run to be reclaimed")
        return float((started - killed).total_seconds())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--lease", type=float, default=12.0)
    ap.add_argument("--quick", action="store_true", help="3 kills each, lease 6 s")
    results_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.repeat, args.lease = min(args.repeat, 3), min(args.lease, 6.0)
    name = "leasework_bench_recovery"
    dsn = bench_database(args.dsn, name)
    fast: list[float] = []
    slow: list[float] = []
    rest: list[tuple[int, int]] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            db.migrate(conn)
            with tempfile.TemporaryDirectory() as tmp:
                h = Harness(dsn, Path(tmp), args.lease)
                try:
                    sup = h.start("supervise", "--processes", "2")
                    kids = wait_for(
                        lambda: len(children(sup.pid)) == 2 and children(sup.pid), 30, "children"
                    )
                    time.sleep(3.0)  # idle past a first poll: memory at rest
                    rest = [memory_kb(p) for p in kids]
                    for _ in range(args.repeat):
                        fast.append(h.one_kill(conn))
                        wait_for(lambda: len(children(sup.pid)) == 2, 30, "the restarted child")
                finally:
                    h.stop_all()
                try:
                    for _ in range(2):
                        h.start("worker")
                    for _ in range(args.repeat):
                        slow.append(h.one_kill(conn))
                        h.procs = [p for p in h.procs if p.poll() is None]
                        h.start("worker")  # back to two workers for the next kill
                finally:
                    h.stop_all()
    finally:
        drop_database(args.dsn, name)

    print(
        f"recovery after kill -9 of the child holding a run: {args.repeat} kills each,"
        f" lease {args.lease:g} s, poll 2 s"
    )
    print_table(
        ["recovery", "median s", "range s", "target"],
        [
            ["supervised (fast release)", f"{med(fast):.3f}", spread(fast, ".3f"), "≤ 1 s"],
            ["lease expiry (no supervisor)", f"{med(slow):.3f}", spread(slow, ".3f"), "≈ lease"],
        ],
    )
    print()
    print_table(
        ["child at rest", "RSS MiB", "PSS MiB", "target"],
        [
            [f"child {i + 1}", f"{rss / 1024:.1f}", f"{pss / 1024:.1f}", "≤ 60 MiB RSS"]
            for i, (rss, pss) in enumerate(rest)
        ],
    )
    record(
        args.results, 6, f"kill -9 -> reclaim, supervised ({args.repeat} kills)", med(fast), "s",
        baseline=med(slow), baseline_label=f"no supervisor: lease {args.lease:g} s expiring",
        ratio=med(fast) / med(slow), target_text="≤ 1 s (vs ≈ lease)",
        met=med(fast) <= 1.0, short=args.quick,
        notes=f"ranges: supervised {spread(fast, '.3f')} s, lease expiry {spread(slow, '.3f')} s",
    )  # fmt: skip
    # The issue says 60 MB: checked in decimal megabytes, the stricter reading (57.2 MiB).
    biggest = max(rss for rss, _ in rest) / 1024
    record(
        args.results, 7, f"worker child at rest, largest RSS of {len(rest)}", biggest, "MiB",
        target_text="≤ 60 MB (57.2 MiB)", met=biggest * 2**20 <= 60e6,
        notes="RSS/PSS MiB: "
        + ", ".join(f"{rss / 1024:.1f}/{pss / 1024:.1f}" for rss, pss in rest),
    )  # fmt: skip


if __name__ == "__main__":
    main()
