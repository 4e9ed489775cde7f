"""Idle transactions per child (issue 17, item 3): what a fleet of idle workers costs the database.

`leasework supervise --processes N` with nothing to do, for --seconds, on a database of its own;
the figure is the database's transactions (pg_stat_database: xact_commit + xact_rollback) per
second, divided by N (the parent's few are shared out). Two ways, interleaved round by round:

- poll: idle_poll_max = poll_interval, so every stage is asked every poll_interval (how idle
  workers behaved before they could sleep until something is due);
- sleep: the defaults (idle_poll_max 30 s): a worker sleeps until a NOTIFY, the next due run,
  lease expiry, schedule or maintenance period, or idle_poll_max.

Each for two apps: `plain` (one task kind) and `families` (the Syncs and Documents families and
a periodic task every hour); `--apps plain,rate_limited` adds a kind whose due runs are all
rate-limited (issue 31: its workers must sleep as the plain app's do). poll_interval is the
default 2 s. Prints a table; asserts nothing.

The count is the database's, so it holds whatever else runs there: the database is vacuumed and
analyzed after its schema is made, and autovacuum is then turned off on its tables (its visits,
set off by the previous window's writes whichever way that ran, would be counted in the next);
each round first measures a window of the same length with no worker at all, which is
subtracted (printed as `background`); and a first unmeasured run of each app warms it all up. Backends report their counts when they go idle (an idle one within 10 s): the
window starts well after start-up and spans at least two idle_poll_max periods, and the figure is
a rate over it, not a count of polls.

    .venv/bin/python bench/idle.py [--dsn DSN] [--processes 4] [--seconds 60] [--rounds 1] [--quick]
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
from pathlib import Path
from typing import Any

import psycopg
from common import DEFAULT_DSN, bench_database, drop_database, med, print_table, spread

from leasework import db
from leasework.config import Config

APPS = {
    "plain": textwrap.dedent(
        """
        from leasework import App

        app = App()


        @app.task("job")
        def job(ctx, payload):
            return None
        """
    ),
    "families": textwrap.dedent(
        """
        from leasework import App
        from leasework.documents import Documents
        from leasework.syncs import Syncs

        app = App()
        app.use(Syncs())
        app.use(Documents())


        @app.task("job")
        def job(ctx, payload):
            return None


        @app.task("hourly", every=3600)
        def hourly(ctx, payload):
            return None
        """
    ),
    # Issue 31: every due run rate-limited (a rate of 1 an hour, its claim made; rate_limited()
    # queues the runs): idle workers sleep until the window frees, as with nothing to do.
    "rate_limited": textwrap.dedent(
        """
        from leasework import App

        app = App()


        @app.task("metered", rate="1/1h")
        def metered(ctx, payload):
            return None
        """
    ),
}
POLL_INTERVAL = 2.0
WARM_UP = 12.0  # past start-up and the statistics' 10 s idle flush


def rate_limited(conn: psycopg.Connection[Any]) -> None:
    """For the `rate_limited` app: its kind's window full for the next hour (one claim recorded
    now, as the app declares its rate) and ten runs of it due, which no claim may take."""
    conn.execute(
        "INSERT INTO leasework.kind_limits (kind, declared)"
        " VALUES ('metered', '{\"rate\": [1, 3600.0]}');"
        "UPDATE leasework.rate_shards"  # its one shard, made as the rate was set
        " SET win = leasework.rate_recorded(NULL, 3600, leasework.now(), 1)"
        " WHERE kind = 'metered';"
        "INSERT INTO leasework.runs (kind) SELECT 'metered' FROM generate_series(1, 10)"
    )


def transactions(admin: psycopg.Connection[Any], name: str) -> int:
    """Committed and rolled back transactions of database `name` so far (read from another
    database, so the reading adds none)."""
    admin.execute("SELECT pg_stat_clear_snapshot()")
    row = admin.execute(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", (name,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def control_sessions(admin: psycopg.Connection[Any], name: str) -> int:
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
        " AND application_name LIKE 'leasework:%%:control'",
        (name,),
    ).fetchone()
    return int(row[0]) if row else 0


def window(admin: psycopg.Connection[Any], name: str, seconds: float) -> float:
    """Transactions per second of database `name` over `seconds` from now."""
    before, t0 = transactions(admin, name), time.monotonic()
    time.sleep(seconds)  # the measured window
    return (transactions(admin, name) - before) / (time.monotonic() - t0)


def one_round(
    admin: psycopg.Connection[Any],
    name: str,
    dsn: str,
    tmp: Path,
    app: str,
    mode: str,
    processes: int,
    seconds: float,
) -> float:
    """Transactions per second of `processes` idle children and their parent, over `seconds`."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp), *sys.path]),
        "LEASEWORK_POLL_INTERVAL": str(POLL_INTERVAL),
        "LEASEWORK_LOG_LEVEL": "warning",
    }
    env.pop("LEASEWORK_CONFIG", None)
    if mode == "poll" and "idle_poll_max" in {f for f in Config.__dataclass_fields__}:
        env["LEASEWORK_IDLE_POLL_MAX"] = str(POLL_INTERVAL)
    sup = subprocess.Popen(
        [sys.executable, "-m", "leasework", "supervise", "--app", f"idle_{app}:app",
         "--dsn", dsn, "--processes", str(processes)],
        cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while control_sessions(admin, name) < processes:
            if time.monotonic() > deadline:
                raise RuntimeError("the children did not start within 60 s")
            time.sleep(0.2)  # polling the boot
        time.sleep(WARM_UP)  # not measured
        return window(admin, name, seconds)
    finally:
        sup.send_signal(signal.SIGTERM)
        try:
            sup.wait(60)
        except subprocess.TimeoutExpired:
            sup.kill()
            sup.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60.0, help="measured window per run")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--modes", default="poll,sleep", help="poll, sleep or both (comma-separated)")
    ap.add_argument("--apps", default="plain,families")
    ap.add_argument("--quick", action="store_true", help="30 s windows, the plain app only")
    ap.add_argument("--results", help="accepted for `make bench`; this script records nothing")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.apps = min(args.seconds, 30.0), "plain"
    apps, modes = args.apps.split(","), args.modes.split(",")
    name = "leasework_bench_idle"
    dsn = bench_database(args.dsn, name)
    rates: dict[tuple[str, str], list[float]] = {}
    backgrounds: list[float] = []
    try:
        # Closed before measuring: a session reports its counts when it ends (or idle, later).
        with psycopg.connect(dsn, autocommit=True) as conn:
            db.migrate(conn)
            if "rate_limited" in apps:
                rate_limited(conn)
            conn.execute("VACUUM ANALYZE")
            for (table,) in conn.execute(
                "SELECT format('%I.%I', schemaname, relname) FROM pg_stat_user_tables"
            ).fetchall():
                conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
            # The catalogs too (those changes left dead rows there): else autovacuum would clean
            # them up during the first window.
            conn.execute("VACUUM ANALYZE")
            conn.execute("VACUUM")
        with (
            psycopg.connect(args.dsn, autocommit=True) as admin,
            tempfile.TemporaryDirectory() as tmp,
        ):
            time.sleep(2)  # let the server take the closed session's counts in
            for app, text in APPS.items():
                (Path(tmp) / f"idle_{app}.py").write_text(text)
            # Not measured: the first windows after the database was made counted up to three
            # times what the same window did a round later (the server's own first visits).
            for app in apps:
                one_round(admin, name, dsn, Path(tmp), app, "poll", args.processes, 30.0)
            for _ in range(args.rounds):
                background = window(admin, name, args.seconds)
                backgrounds.append(background)
                print(f"  background      {background:.3f} transactions/s (no worker)", flush=True)
                for app in apps:
                    for mode in modes:  # interleaved: poll, sleep, poll, sleep...
                        total = one_round(
                            admin, name, dsn, Path(tmp), app, mode, args.processes, args.seconds
                        )
                        rate = max(0.0, total - background) / args.processes
                        rates.setdefault((app, mode), []).append(rate)
                        print(f"  {app:9} {mode:5} {rate:.3f} transactions/s per child", flush=True)
    finally:
        drop_database(args.dsn, name)
    load = os.getloadavg()
    print()
    print(
        f"Idle transactions per child: {args.processes} children, {args.seconds:g} s windows, "
        f"{args.rounds} round(s), poll_interval {POLL_INTERVAL:g} s; background "
        f"{med(backgrounds):.3f} transactions/s subtracted; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    rows = []
    for app in apps:
        poll, sleep = rates.get((app, "poll")), rates.get((app, "sleep"))
        cut = f"{med(poll) / med(sleep):.1f} x" if poll and sleep and med(sleep) > 0 else "-"
        rows.append(
            [
                app,
                "-" if not poll else f"{med(poll):.3f} ({spread(poll, '.3f')})",
                "-" if not sleep else f"{med(sleep):.3f} ({spread(sleep, '.3f')})",
                cut,
            ]
        )
    print_table(["app", "poll every poll_interval", "sleep until due", "cut"], rows)


if __name__ == "__main__":
    main()
