"""The `schedule` stage, first in poll order: enqueue due connections' syncs and due periodic
user tasks, each bounded per poll, with `next_run_at` set from now (never from its old value), so
downtime never turns into a backlog. Never executes a run; the `runs` stage does."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import psycopg
from cronsim import CronSim, CronSimError
from psycopg.rows import dict_row

from .. import log
from ..errors import ConfigError
from ..queries import load
from ..workers.stage import Site

if TYPE_CHECKING:
    from ..app import App, Family

Q = load("leasework.stages", "schedule.sql")
Conn = psycopg.Connection[Any]


@dataclass(frozen=True)
class ScheduleSpec:
    """When a periodic task fires: every `every` seconds, or on `cron` in time zone `tz`."""

    kind: str
    every: float | None = None
    cron: str | None = None
    tz: str = "UTC"

    @classmethod
    def make(
        cls, kind: str, *, every: float | None = None, cron: str | None = None, tz: str = "UTC"
    ) -> ScheduleSpec:
        """Validate and build; ConfigError names what is wrong."""
        if (every is None) == (cron is None):
            raise ConfigError(f"task {kind!r}: give exactly one of every= and cron=")
        if every is not None and (
            isinstance(every, bool)
            or not isinstance(every, int | float)
            or not math.isfinite(every)
            or every <= 0
        ):
            raise ConfigError(
                f"task {kind!r}: every must be a positive number of seconds, got {every!r}"
            )
        zone = _zone(kind, tz)
        if cron is not None:
            if not isinstance(cron, str):
                raise ConfigError(f"task {kind!r}: cron must be a string, got {cron!r}")
            try:
                next(CronSim(cron, datetime.now(zone)))
            except (CronSimError, StopIteration) as exc:
                raise ConfigError(f"task {kind!r}: cron {cron!r} is not valid: {exc}") from None
        return cls(kind, None if every is None else float(every), cron, tz)

    @property
    def name(self) -> str:
        """The schedule's row name; one schedule per task kind."""
        return self.kind

    @property
    def key(self) -> str:
        """The run key of its runs: one active run per schedule."""
        return f"schedule:{self.kind}"

    def describe(self) -> str:
        return f"every {self.every:g}s" if self.every is not None else f"cron {self.cron} {self.tz}"


def _zone(kind: str, tz: object) -> ZoneInfo:
    if not isinstance(tz, str) or not tz:
        raise ConfigError(f"task {kind!r}: tz must be an IANA time zone name, got {tz!r}")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigError(
            f"task {kind!r}: unknown time zone {tz!r} (use an IANA name such as Europe/Berlin)"
        ) from None


def next_fire(spec: ScheduleSpec, now: datetime) -> datetime:
    """The next time after `now` (an aware datetime) the schedule fires, in UTC. Always computed
    from now, never from the previous fire time: that is the no-backlog rule."""
    if spec.every is not None:
        return (now + timedelta(seconds=spec.every)).astimezone(UTC)
    assert spec.cron is not None
    local = now.astimezone(ZoneInfo(spec.tz))
    return next(CronSim(spec.cron, local)).astimezone(UTC)


def first_fire(spec: ScheduleSpec, now: datetime) -> datetime:
    """A new `every` schedule fires at once; a new cron schedule at its next match."""
    return now.astimezone(UTC) if spec.every is not None else next_fire(spec, now)


# -- effects ---------------------------------------------------------------------------------


def _db_now(conn: Conn) -> datetime:
    row = conn.execute(Q["schedules_now"]).fetchone()
    assert row is not None
    value: datetime = row[0]
    return value


def register_schedules(conn: Conn, specs: list[ScheduleSpec]) -> None:
    """Upsert the rows of the app's periodic tasks (unchanged ones keep their next_run_at)."""
    if not specs:
        return
    with conn.transaction():
        now = _db_now(conn)
        for spec in specs:
            conn.execute(
                Q["upsert_schedule"],
                {
                    "name": spec.name,
                    "kind": spec.kind,
                    "every": spec.every,
                    "cron": spec.cron,
                    "tz": spec.tz,
                    "first": first_fire(spec, now),
                },
            )


def enqueue_due_tasks(app: App, conn: Conn, limit: int) -> int:
    """Enqueue each due periodic task of this app (bounded); returns how many were due."""
    specs = app.schedules
    if not specs:
        return 0
    with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            Q["lock_due_schedules"], {"names": list(specs), "limit": limit}
        ).fetchall()
        for row in rows:
            spec = specs[row["name"]]
            run_id = app.enqueue(
                conn,
                spec.kind,
                {"scheduled_at": row["next_run_at"].isoformat()},
                key=spec.key,
            )
            nxt = next_fire(spec, row["now"])
            cur.execute(Q["advance_schedule"], {"name": spec.name, "next": nxt, "run_id": run_id})
            log.event("task_scheduled", kind=spec.kind, run_id=run_id, next_run_at=nxt.isoformat())
    return len(rows)


def list_schedules(conn: Conn) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(Q["list_schedules"]).fetchall()


class ScheduleStage:
    name = "schedule"
    wakes: frozenset[str] = frozenset()

    def __init__(self, app: App, *, limit: int = 10, families: Sequence[Family] = ()) -> None:
        self.app = app
        self.limit = limit
        self.families = tuple(families)
        self._registered = False

    def step(self, site: Site) -> int:
        with site.conns.pooled() as conn:
            if not self._registered:
                register_schedules(conn, list(self.app.schedules.values()))
                self._registered = True
            handled = sum(f.enqueue_due(conn, self.limit) for f in self.families)
            handled += enqueue_due_tasks(self.app, conn, self.limit)
        return handled
