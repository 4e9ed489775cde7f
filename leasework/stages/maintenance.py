"""The `maintenance` stage: housekeeping handlers that throttle themselves on a durable marker.

Every poll reads the markers once (one query); a handler whose period has passed is claimed
with one conditional upsert that only one worker can win per period, then runs one bounded
batch. A handler that hit its bound leaves a backlog flag, so the next poll (anywhere)
continues without waiting a whole period. Adding a handler is one `Handler` in `HANDLERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.types.json import Jsonb

from .. import log
from ..queries import load
from ..workers import lease
from ..workers.stage import Site

if TYPE_CHECKING:
    from ..app import App
    from ..config import Config

Q = load("leasework.stages", "maintenance.sql")
Conn = psycopg.Connection[Any]


@dataclass(frozen=True)
class Handler:
    """`run(conn, app, limit)` deletes at most `limit` rows and returns how many it did."""

    name: str
    period: Callable[[Config], float]
    run: Callable[[Conn, App, int], int]


def due(last_run_at: datetime | None, backlog: bool, period: float, now: datetime) -> bool:
    """Pure: is a handler due? Never run, a backlog left, or its period has passed."""
    if last_run_at is None or backlog:
        return True
    return now - last_run_at >= timedelta(seconds=period)


def prune_runs(conn: Conn, app: App, limit: int) -> int:
    cfg = app.config
    retention = {
        "succeeded": cfg.retention_succeeded,
        "partial": cfg.retention_partial,
        "failed": cfg.retention_failed,
        "cancelled": cfg.retention_cancelled,
    }
    params = {**retention, "shortest": min(retention.values()), "limit": limit}
    return len(conn.execute(Q["prune_runs"], params).fetchall())


def prune_workers(conn: Conn, app: App, limit: int) -> int:
    params = {"retention": app.config.retention_workers, "limit": limit}
    return len(conn.execute(Q["prune_workers"], params).fetchall())


def prune_uploads(conn: Conn, app: App, limit: int) -> int:
    """Finished uploads past retention: the archive's bytes, then the row (the files expanded
    from it stay; their upload_id becomes NULL)."""
    rows = conn.execute(
        Q["old_uploads"], {"retention": app.config.retention_uploads, "limit": limit}
    ).fetchall()
    if not rows:
        return 0
    store = app.file_store()
    for _, key in rows:
        store.delete(key)
    return len(conn.execute(Q["delete_uploads"], {"ids": [r[0] for r in rows]}).fetchall())


def prune_tombstones(conn: Conn, app: App, limit: int) -> int:
    """Records tombstoned (gone upstream) longer ago than the retention."""
    params = {"retention": app.config.retention_tombstones, "limit": limit}
    return len(conn.execute(Q["prune_tombstones"], params).fetchall())


def reconcile_files(conn: Conn, app: App, limit: int) -> int:
    """Files stuck `indexing` after their ingest run ended without its handler."""
    return len(conn.execute(Q["reconcile_files"], {"limit": limit}).fetchall())


HANDLERS: tuple[Handler, ...] = (
    Handler("prune_runs", lambda c: c.prune_interval, prune_runs),
    Handler("prune_uploads", lambda c: c.prune_interval, prune_uploads),
    Handler("prune_workers", lambda c: c.workers_prune_interval, prune_workers),
    Handler("prune_tombstones", lambda c: c.prune_interval, prune_tombstones),
    Handler("reconcile_files", lambda c: c.reconcile_interval, reconcile_files),
)


class MaintenanceStage:
    name = "maintenance"
    wakes: frozenset[str] = frozenset()

    def __init__(
        self,
        app: App,
        config: Config,
        *,
        handlers: Sequence[Handler] = HANDLERS,
        limit: int | None = None,
    ) -> None:
        self.app = app
        self.config = config
        self.handlers = tuple(handlers)
        self.limit = limit if limit is not None else config.maintenance_limit

    def step(self, site: Site) -> int:
        done = 0
        with site.conns.pooled() as conn:
            rows = conn.execute(Q["read_markers"]).fetchall()
            now = rows[0][3] if rows else lease.db_now(conn)
            markers = {r[0]: (r[1], r[2]) for r in rows}
            for h in self.handlers:
                last, backlog = markers.get(h.name, (None, False))
                period = h.period(self.config)
                if not due(last, backlog, period, now):
                    continue
                claimed = conn.execute(
                    Q["claim_maintenance"], {"handler": h.name, "period": period}
                ).fetchone()
                if claimed is None:
                    continue  # another worker won this period
                done += self._run(conn, h)
        return done

    def _run(self, conn: Conn, h: Handler) -> int:
        """One bounded batch; a failure is logged and recorded on the marker, and the other
        handlers still run. It is tried again next period."""
        try:
            n = h.run(conn, self.app, self.limit)
        except Exception as exc:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                conn.rollback()
            log.event("maintenance_failed", level=40, handler=h.name, error=str(exc))
            result: dict[str, Any] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            conn.execute(
                Q["record_maintenance"],
                {"handler": h.name, "backlog": False, "result": Jsonb(result)},
            )
            return 0
        more = n >= self.limit
        conn.execute(
            Q["record_maintenance"],
            {"handler": h.name, "backlog": more, "result": Jsonb({"deleted": n})},
        )
        if n:
            log.event("maintenance_ran", handler=h.name, deleted=n, backlog=more)
        return n
