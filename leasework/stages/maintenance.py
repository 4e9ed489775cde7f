"""The `maintenance` stage: housekeeping handlers that throttle themselves on a durable marker.

Every poll reads the markers once (one query); a handler whose period has passed is claimed
with one conditional upsert that only one worker can win per period, then runs one bounded
batch. A handler that hit its bound leaves a backlog flag, so the next poll (anywhere)
continues without waiting a whole period. Adding one is a `Pruner` in `PRUNERS` (or in a
family's `pruners()`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from .. import log
from ..config import DAY, RETENTION, Config, Range, doc, section
from ..queries import load
from ..workers import lease
from ..workers.stage import Site

Q = load("leasework.stages", "maintenance.sql")
Conn = psycopg.Connection[Any]


@section("The `maintenance` stage", order=30)
@dataclass(frozen=True)
class MaintenanceSettings:
    maintenance_limit: int = field(
        default=1000,
        metadata=doc(
            "rows each maintenance handler deletes per poll at most", range=Range(1, 1_000_000)
        ),
    )
    prune_interval: float = field(
        default=3600.0,
        metadata=doc(
            "seconds between prunes of finished runs and uploads", range=Range(1, 30 * DAY)
        ),
    )
    workers_prune_interval: float = field(
        default=86400.0,
        metadata=doc("seconds between prunes of stopped worker rows", range=Range(1, 30 * DAY)),
    )
    retention_succeeded: float = field(
        default=7 * 86400.0, metadata=doc("seconds a succeeded run is kept", range=RETENTION)
    )
    retention_partial: float = field(
        default=30 * 86400.0, metadata=doc("seconds a partial run is kept", range=RETENTION)
    )
    retention_failed: float = field(
        default=30 * 86400.0, metadata=doc("seconds a failed run is kept", range=RETENTION)
    )
    retention_cancelled: float = field(
        default=7 * 86400.0, metadata=doc("seconds a cancelled run is kept", range=RETENTION)
    )
    retention_workers: float = field(
        default=86400.0,
        metadata=doc("seconds a stopped (or long silent) worker row is kept", range=RETENTION),
    )


def settings(cfg: Config) -> MaintenanceSettings:
    return cfg.section(MaintenanceSettings)


@dataclass(frozen=True)
class Pruner:
    """`run(conn, config, limit)` deletes at most `limit` rows and returns how many it did."""

    name: str
    period: Callable[[Config], float]
    run: Callable[[Conn, Config, int], int]


def due(last_run_at: datetime | None, backlog: bool, period: float, now: datetime) -> bool:
    """Pure: is a handler due? Never run, a backlog left, or its period has passed."""
    if last_run_at is None or backlog:
        return True
    return now - last_run_at >= timedelta(seconds=period)


def prune_runs(conn: Conn, cfg: Config, limit: int) -> int:
    s = settings(cfg)
    retention = {
        "succeeded": s.retention_succeeded,
        "partial": s.retention_partial,
        "failed": s.retention_failed,
        "cancelled": s.retention_cancelled,
    }
    params = {**retention, "shortest": min(retention.values()), "limit": limit}
    return len(conn.execute(Q["prune_runs"], params).fetchall())


def prune_workers(conn: Conn, cfg: Config, limit: int) -> int:
    params = {"retention": settings(cfg).retention_workers, "limit": limit}
    return len(conn.execute(Q["prune_workers"], params).fetchall())


PRUNERS: tuple[Pruner, ...] = (
    Pruner("prune_runs", lambda c: settings(c).prune_interval, prune_runs),
    Pruner("prune_workers", lambda c: settings(c).workers_prune_interval, prune_workers),
)


class MaintenanceStage:
    name = "maintenance"
    settings = MaintenanceSettings
    wakes: frozenset[str] = frozenset()

    def __init__(
        self,
        config: Config,
        *,
        handlers: Sequence[Pruner] = PRUNERS,
        extra: Sequence[Pruner] = (),
        limit: int | None = None,
    ) -> None:
        self.config = config
        self.handlers = (*handlers, *extra)
        self.limit = limit if limit is not None else settings(config).maintenance_limit

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

    def _run(self, conn: Conn, h: Pruner) -> int:
        """One bounded batch; a failure is logged and recorded on the marker, and the other
        handlers still run. It is tried again next period."""
        try:
            n = h.run(conn, self.config, self.limit)
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
