"""What one host costs Postgres in connections (docs/operations.md, "Sizing"): a real `leasework
supervise --processes P` on a bench database, its sessions counted in pg_stat_activity by role
(control, keeper, pool, supervisor, listen), sampled through three phases:

- idle: booted, every stage polled, no run yet;
- busy: P x 10 runs, each holding its fenced transaction (`ctx.transaction()`) for --hold
  seconds (past a renewal: the lease is --lease seconds) and checkpointing in it: the most
  sessions seen at once;
- after: the runs done, a few seconds later.

Prints the counts and the formula's figures (2P + 1 running, P x (pool_size + 1) + 1 at most).
Asserts nothing. Run it with PYTHONPATH pointing at another checkout to compare.

    .venv/bin/python bench/connections.py [--dsn DSN] [--processes 4] [--hold 1.5] [--lease 3]
"""

from __future__ import annotations

import argparse
import collections
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
from common import DEFAULT_DSN, bench_database, drop_database, print_table

from leasework import App, db

APP = textwrap.dedent(
    """
    import time
    from leasework import App

    app = App()


    @app.task("step")
    def step(ctx, payload):
        with ctx.transaction() as tx:
            tx.execute("SELECT pg_sleep(%s)", (payload["hold"],))
            ctx.checkpoint(1)
    """
)
ROLES = ("control", "keeper", "pool", "listen", "supervisor")


def sessions(conn: psycopg.Connection[Any]) -> dict[str, int]:
    rows = conn.execute(
        "SELECT application_name FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name LIKE 'leasework:%%'"
    ).fetchall()
    out: collections.Counter[str] = collections.Counter()
    for (name,) in rows:
        if name.startswith("leasework:supervisor"):
            out["listen" if name.endswith(":listen") else "supervisor"] += 1
        else:
            out[name.rsplit(":", 1)[-1] if name.count(":") == 2 else "pool"] += 1
    return dict(out)


def most(samples: list[dict[str, int]]) -> dict[str, int]:
    """The sample with the most sessions in all."""
    return max(samples, key=lambda s: sum(s.values()), default={})


def sample_for(conn: psycopg.Connection[Any], seconds: float) -> list[dict[str, int]]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(sessions(conn))
        time.sleep(0.05)  # sampling period
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--hold", type=float, default=1.5, help="seconds in each transaction")
    ap.add_argument("--lease", type=float, default=3.0, help="lease seconds (renewed at a third)")
    args = ap.parse_args()
    p = args.processes
    runs = p * 10
    name = "leasework_bench_connections"
    dsn = bench_database(args.dsn, name)
    phases: dict[str, dict[str, int]] = {}
    try:
        with psycopg.connect(dsn, autocommit=True) as conn, tempfile.TemporaryDirectory() as tmp:
            db.migrate(conn)
            (Path(tmp) / "connapp.py").write_text(APP)
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([tmp, *sys.path]),
                "LEASEWORK_LEASE": str(args.lease),
            }
            sup = subprocess.Popen(
                [sys.executable, "-m", "leasework", "supervise", "--app", "connapp:app",
                 "--dsn", dsn, "--processes", str(p)],
                cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                deadline = time.monotonic() + 60
                while sessions(conn).get("control", 0) < p and time.monotonic() < deadline:
                    time.sleep(0.1)  # polling the boot
                phases["idle"] = most(sample_for(conn, 3.0))
                app = App()
                app.task("step")(lambda ctx, payload: None)
                for _ in range(runs):
                    app.enqueue(conn, "step", {"hold": args.hold})
                busy: list[dict[str, int]] = []
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    busy += sample_for(conn, 0.5)
                    left = conn.execute(
                        "SELECT count(*) FROM leasework.runs WHERE status <> 'succeeded'"
                    ).fetchone()
                    if left is not None and left[0] == 0:
                        break
                phases["busy"] = most(busy)
                phases["after"] = most(sample_for(conn, 3.0))
            finally:
                sup.send_signal(signal.SIGTERM)
                sup.wait(30)
    finally:
        drop_database(args.dsn, name)

    print(
        f"connections of one host: leasework supervise --processes {p}, pool_size 4, {runs} runs"
        f" of {args.hold:g} s in a transaction, lease {args.lease:g} s"
    )
    print_table(
        ["phase", *ROLES, "total", "formula"],
        [
            [
                phase,
                *(str(counts.get(r, 0)) for r in ROLES),
                str(sum(counts.values())),
                {"idle": f"P + 1 = {p + 1}", "busy": f"2P + 1 = {2 * p + 1}",
                 "after": f"2P + 1 = {2 * p + 1}"}[phase],
            ]
            for phase, counts in phases.items()
        ],
    )  # fmt: skip
    print(f"at most P x (pool_size + 1) + 1 = {p * 5 + 1}")


if __name__ == "__main__":
    main()
