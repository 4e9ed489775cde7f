"""The `maintenance` stage: housekeeping handlers that throttle themselves on a durable marker.

Every poll reads the markers once (one query); a handler whose period has passed is claimed
with one conditional upsert that only one worker can win per period, then runs one bounded
batch. A handler that hit its bound leaves a backlog flag, so the next poll (anywhere)
continues without waiting a whole period. Adding one is a `Pruner` in `PRUNERS` (or in a
family's `pruners()`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from .. import log
from ..config import DAY, RETENTION, Config, Range, doc, section
from ..leases import lease
from ..queries import load
from ..workers import idle
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
    unknown_kind_after: float = field(
        default=3600.0,
        metadata=doc(
            "seconds a queued run of a kind no worker has a handler for waits before maintenance "
            "ends it failed (0: never)",
            range=Range(0, 30 * DAY),
        ),
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


def fail_unknown_kinds(conn: Conn, cfg: Config, limit: int) -> int:
    """End `failed` the queued runs whose kind no worker has a handler for (maintenance.sql)."""
    after = settings(cfg).unknown_kind_after
    if not after:
        return 0
    params = {"after": after, "limit": limit}
    failed = [r[0] for r in conn.execute(Q["fail_unknown_kinds"], params).fetchall()]
    if failed:
        log.event("unknown_kind_failed", level=30, runs=len(failed), first=min(failed))
    return len(failed)


def prune_rate_windows(conn: Conn, cfg: Config, limit: int) -> int:
    """Delete tenants' rate windows that count no claim any more (maintenance.sql)."""
    return len(conn.execute(Q["prune_rate_windows"], {"limit": limit}).fetchall())


def _unknown_kinds_period(cfg: Config) -> float:
    # A fraction of the wait, so a run ends not long after it: between one minute and ten.
    return min(max(settings(cfg).unknown_kind_after / 4, 60.0), 600.0)


PRUNERS: tuple[Pruner, ...] = (
    Pruner("prune_runs", lambda c: settings(c).prune_interval, prune_runs),
    Pruner("prune_workers", lambda c: settings(c).workers_prune_interval, prune_workers),
    Pruner("fail_unknown_kinds", _unknown_kinds_period, fail_unknown_kinds),
    Pruner("prune_rate_windows", lambda c: settings(c).prune_interval, prune_rate_windows),
)

# How often each worker re-declares its kinds (leasework.kinds); a kind is known while some
# worker declared it in the last seven days (maintenance.sql, fail_unknown_kinds).
DECLARE_EVERY = 3600.0


class MaintenanceStage:
    name = "maintenance"
    settings = MaintenanceSettings
    wakes: frozenset[str] = frozenset()
    # Only the periods on its markers make it due: an idle worker need not ask it before then
    # (workers/stage.py, Due).
    exact_due = True

    def __init__(
        self,
        config: Config,
        *,
        handlers: Sequence[Pruner] = PRUNERS,
        extra: Sequence[Pruner] = (),
        limit: int | None = None,
        kinds: Sequence[str] = (),
        accepts: Mapping[str, Mapping[str, Any]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.handlers = (*handlers, *extra)
        self.limit = limit if limit is not None else settings(config).maintenance_limit
        self.kinds = sorted(kinds)  # the kinds this worker has handlers for
        # What each one's handler takes (tasks.Accepts.declared), recorded with it (None: not
        # declared here, the recorded one kept).
        self.accepts = [
            None if accepts is None or k not in accepts else Jsonb(dict(accepts[k]))
            for k in self.kinds
        ]
        self._clock = clock
        self._declared_at: float | None = None
        self._due: idle.Seen = None

    def step(self, site: Site) -> int:
        done = 0
        self._due = None
        with site.conns.pooled() as conn:
            self._declare(conn)
            rows = conn.execute(Q["read_markers"]).fetchall()
            now = rows[0][3] if rows else lease.db_now(conn)
            markers = {r[0]: (r[1], r[2]) for r in rows}
            # When each handler is next due, from the markers just read: a period from now for
            # one that ran now (here or, the claim lost, elsewhere). What `next_due` tells.
            dues: list[float | None] = [self._declare_due()]
            for h in self.handlers:
                last, backlog = markers.get(h.name, (None, False))
                period = h.period(self.config)
                if not due(last, backlog, period, now):
                    assert last is not None
                    dues.append((last - now).total_seconds() + period)
                    continue
                dues.append(period)
                claimed = conn.execute(
                    Q["claim_maintenance"], {"handler": h.name, "period": period}
                ).fetchone()
                if claimed is None:
                    continue  # another worker won this period
                done += self._run(conn, h)
        self._due = idle.earliest(dues), time.monotonic()
        return done

    def next_due(self, site: Site) -> float | None:
        """Seconds until a handler's period (or the hourly declaration of kinds) comes round, as
        the last step read the markers (workers/stage.py, Due)."""
        return idle.due_now(self._due, time.monotonic())

    def _declare_due(self) -> float | None:
        if not self.kinds or self._declared_at is None:
            return None
        return DECLARE_EVERY - (self._clock() - self._declared_at)

    def _declare(self, conn: Conn) -> None:
        """Record this worker's kinds, and what their handlers take, in leasework.kinds: at the
        first poll, then hourly (the last declaration stands)."""
        now = self._clock()
        if not self.kinds or (
            self._declared_at is not None and now - self._declared_at < DECLARE_EVERY
        ):
            return
        conn.execute(Q["declare_kinds"], {"kinds": self.kinds, "accepts": self.accepts})
        self._declared_at = now

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
