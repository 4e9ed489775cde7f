"""The `schedule` stage, first in poll order: enqueue due periodic tasks and each family's due
work (a connection's syncs), each bounded per poll, with `next_run_at` set from now (never from its old value), so
downtime never turns into a backlog. Never executes a run; the `runs` stage does."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from .. import log
from ..config import Range, doc, section
from ..queries import load
from ..status import tolerant
from ..tasks import Registry, ScheduleSpec, first_fire, next_fire
from ..workers import idle
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
    """Every schedule, for `leasework schedules` and the dashboard; a timestamp Python cannot
    hold (infinity) is read as status.tolerant reads it."""
    with tolerant(conn.cursor(row_factory=dict_row)) as cur:
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
        next_due: Sequence[Callable[[Conn], float | None]] = (),
    ) -> None:
        self.app = app
        self.limit = limit
        self.due = tuple(due)  # each family's enqueue_due(conn, limit)
        self.next_dues = tuple(next_due)  # each family's next_due(conn)
        self._registered = False
        self._due: idle.Seen = None

    def step(self, site: Site) -> int:
        self._due = None
        with site.conns.pooled() as conn:
            if not self._registered:
                register_schedules(conn, list(self.app.schedules.values()))
                self._registered = True
            if not self.due and not self.app.schedules:
                self._due = None, time.monotonic()  # nothing to schedule, ever
                return 0
            # One transaction for every due check and, when none was due, the time the next one
            # is (`next_due`): an idle worker's turn of this stage is one commit.
            with conn.transaction():
                handled = sum(enqueue(conn, self.limit) for enqueue in self.due)
                handled += enqueue_due_tasks(self.app, conn, self.limit)
                if not handled:
                    self._due = self._read_next_due(conn), time.monotonic()
        return handled

    def _read_next_due(self, conn: Conn) -> float | None:
        dues = [next_due(conn) for next_due in self.next_dues]
        if self.app.schedules:
            row = conn.execute(Q["next_schedule"], {"names": list(self.app.schedules)}).fetchone()
            dues.append(None if row is None or row[0] is None else float(row[0]))
        return idle.earliest(dues)

    def next_due(self, site: Site) -> float | None:
        """Seconds until the next periodic task or family's scheduled work is due, as the last
        step read it (workers/stage.py, Due)."""
        return idle.due_now(self._due, time.monotonic())
