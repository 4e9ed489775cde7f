"""The `schedule` stage, first in poll order: enqueue due periodic tasks and each family's due
work (a connection's syncs), each bounded per poll, with `next_run_at` set from now (never from its old value), so
downtime never turns into a backlog. Never executes a run; the `runs` stage does."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from .. import log
from ..config import Range, doc, section
from ..queries import load
from ..tasks import Registry, ScheduleSpec, first_fire, next_fire
from ..workers.stage import Site

Q = load("leasework.stages", "schedule.sql")
Conn = psycopg.Connection[Any]


@section("The `schedule` stage", order=20)
@dataclass(frozen=True)
class ScheduleSettings:
    schedule_limit: int = field(
        default=10,
        metadata=doc(
            "due connections and due periodic tasks each enqueued per poll at most",
            range=Range(1, 1000),
        ),
    )


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


def enqueue_due_tasks(app: Registry, conn: Conn, limit: int) -> int:
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
    settings = ScheduleSettings
    wakes: frozenset[str] = frozenset()

    def __init__(
        self,
        app: Registry,
        *,
        limit: int = 10,
        due: Sequence[Callable[[Conn, int], int]] = (),
    ) -> None:
        self.app = app
        self.limit = limit
        self.due = tuple(due)  # each family's enqueue_due(conn, limit)
        self._registered = False

    def step(self, site: Site) -> int:
        with site.conns.pooled() as conn:
            if not self._registered:
                register_schedules(conn, list(self.app.schedules.values()))
                self._registered = True
            handled = sum(enqueue(conn, self.limit) for enqueue in self.due)
            handled += enqueue_due_tasks(self.app, conn, self.limit)
        return handled
