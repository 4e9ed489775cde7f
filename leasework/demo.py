"""`leasework demo`: migrate, enqueue a handful of sample tasks (one fails once and is retried,
one is cancelled, one reports progress), run a worker until they are done, print the outcome."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

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
            synced = connection_demo(app, conn, worker)
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
    return 0 if ok and synced else 1


def _wait(worker: Worker, conn: Any, run_id: int, seconds: float = 20.0) -> str:
    """Poll until the run has finished; returns its status."""
    deadline = time.monotonic() + seconds
    status = "?"
    while time.monotonic() < deadline:
        worker.poll()
        row = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
        status = row[0] if row else "gone"
        if status in ("succeeded", "partial", "failed", "cancelled"):
            break
        time.sleep(0.05)
    return str(status)


def _write(root: Path, projects: list[dict[str, Any]], tasks: list[tuple[str, str]]) -> None:
    (root / "projects.jsonl").write_bytes(b"".join(orjson.dumps(p) + b"\n" for p in projects))
    (root / "tasks.csv").write_text(
        "id,title\n" + "".join(f"{i},{t}\n" for i, t in tasks), encoding="utf-8"
    )


def connection_demo(app: App, conn: Any, worker: Worker) -> bool:
    """A `files` connection synced twice while its directory changes in between (one row edited,
    two removed upstream and so tombstoned, one added), then deleted through a purge run."""
    with tempfile.TemporaryDirectory(prefix="leasework-demo-") as tmp:
        root = Path(tmp)
        _write(
            root,
            [{"id": 1, "name": "Depot"}, {"id": 2, "name": "Bridge"}, {"id": 3, "name": "School"}],
            [("t1", "pour slab"), ("t2", "order steel")],
        )
        cid = app.connect(conn, workspace="demo", provider="files", config={"path": tmp})
        first = conn.execute(
            "SELECT id FROM leasework.runs WHERE key = %s", (f"connection:{cid}",)
        ).fetchone()[0]
        statuses = [_wait(worker, conn, first)]
        _write(
            root,
            [{"id": 1, "name": "Depot"}, {"id": 3, "name": "School (phase 2)"}],
            [("t1", "pour slab"), ("t3", "inspect rebar")],
        )
        second = app.sync_now(conn, cid)
        statuses.append(_wait(worker, conn, second))
        print(f"\nconnection {cid} (files, {tmp}): synced twice, the files changed in between")
        for run_id in (first, second):
            result = conn.execute(
                "SELECT result FROM leasework.runs WHERE id = %s", (run_id,)
            ).fetchone()[0]
            for table, t in sorted((result or {}).get("tables", {}).items()):
                print(
                    f"  run {run_id:>4} {table:<9} upserted {t['upserted']}, "
                    f"tombstoned {t['tombstoned']}"
                )
        live, gone = conn.execute(
            "SELECT count(*) FILTER (WHERE deleted_at IS NULL), "
            "count(*) FILTER (WHERE deleted_at IS NOT NULL) "
            "FROM leasework.records WHERE connection_id = %s",
            (cid,),
        ).fetchone()
        print(f"  records: {live} live, {gone} tombstoned")
        purge = app.delete_connection(conn, cid)
        statuses.append(_wait(worker, conn, purge))
        print(f"  deleted: purge run {purge} {statuses[-1]}")
    return statuses == ["succeeded"] * 3 and (live, gone) == (4, 2)
