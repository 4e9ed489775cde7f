"""`leasework demo`: migrate, enqueue a handful of sample tasks (one fails once and is retried,
one is cancelled, one reports progress), run a worker until they are done, print the outcome."""

from __future__ import annotations

import time
from typing import Any

from . import db
from .app import App
from .config import Config
from .errors import Retry
from .workers.context import Context
from .workers.worker import Worker

demo_app = App()


@demo_app.task("demo.hello")
def hello(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    ctx.check()
    return {"greeting": f"hello, {payload.get('name', 'world')}"}


@demo_app.task("demo.flaky", max_attempts=3)
def flaky(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    if ctx.attempt == 1:
        raise Retry(after=0.5, message="upstream briefly unavailable")
    return {"ok_on_attempt": ctx.attempt}


@demo_app.task("demo.count")
def count(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
    n = int(payload.get("n", 50))
    ctx.set_total(n)
    for i in range(ctx.processed, n):
        ctx.check()
        ctx.checkpoint(i + 1)
    return {"counted": n}


def main(cfg: Config) -> int:
    cfg = cfg.replace(poll_interval=0.2)
    app = demo_app.with_config(cfg)
    with db.connect(cfg.dsn) as conn:
        db.migrate(conn)
        with conn.transaction():
            ids = [
                app.enqueue(conn, "demo.hello", {"name": "leasework"}),
                app.enqueue(conn, "demo.flaky", {}),
                app.enqueue(conn, "demo.count", {"n": 200}),
                app.enqueue(conn, "demo.hello", {"name": "cancelled"}, delay=60),
            ]
        app.cancel(conn, ids[-1])
        print(f"enqueued runs {ids}; the last one cancelled before it started")
        worker = Worker(app, cfg)
        worker.open()
        worker.running = True
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                worker.poll()
                row = conn.execute(
                    "SELECT count(*) FROM leasework.runs WHERE id = ANY(%s) AND finished_at IS NULL",
                    (ids,),
                ).fetchone()
                if row is not None and row[0] == 0:
                    break
                time.sleep(0.1)
        finally:
            worker.close()
        rows = conn.execute(
            "SELECT id, kind, status, attempts, result FROM leasework.runs WHERE id = ANY(%s) ORDER BY id",
            (ids,),
        ).fetchall()
    print(f"{'run':>6}  {'kind':<12} {'status':<10} {'attempts':>8}  result")
    for run_id, kind, status, attempts, result in rows:
        print(f"{run_id:>6}  {kind:<12} {status:<10} {attempts:>8}  {result}")
    ok = [r[2] for r in rows] == ["succeeded", "succeeded", "succeeded", "cancelled"]
    return 0 if ok else 1
