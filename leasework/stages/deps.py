"""The `deps` stage: decides the runs that wait for others (README "Workflows"). A run that
something waits for records its end in `leasework.run_deps_ended` (the trigger runs_parent_ended,
schema.sql), and an enqueue after a run it did not make records that parent there too; each step
takes a bounded batch of those rows, marks each parent, and makes each blocked child whose every
parent has ended `queued` or, by its policy, `cancelled` (deps.sql). Never writes a lease column;
never waits on a row lock (every lock SKIP LOCKED, a row skipped is tried again next step)."""

from __future__ import annotations

from typing import Any

import psycopg

from .. import log
from ..queries import load
from ..workers.stage import Site

Q = load("leasework.stages", "deps.sql")
Conn = psycopg.Connection[Any]

# The NOTIFY payload (channel `leasework`) that asks this stage at once: sent with a parent's end
# by runs_parent_ended, and by an enqueue after a run it did not make (schema.sql).
WAKE = "leasework:deps"


# Inbox rows (ended parents) a step handles at most; each parent's blocked children are decided
# in the same step, however many.
LIMIT = 100


def settle(conn: Conn, limit: int) -> int:
    """One bounded step in its own transaction: the parents taken from the inbox, each marked
    and, once ended, its blocked children decided; their inbox rows deleted unless a row lock
    someone held left one of them undecided. Returns how many inbox rows were handled."""
    with conn.transaction():
        rows = conn.execute(Q["take_ended"], {"limit": limit}).fetchall()
        if not rows:
            return 0
        by_parent: dict[int, list[int]] = {}
        for row_id, parent in rows:
            by_parent.setdefault(int(parent), []).append(int(row_id))
        done: list[int] = []
        decided = 0
        for parent, ids in by_parent.items():
            got = conn.execute(Q["lock_parent"], {"parent": parent}).fetchone()
            assert got is not None
            status, present = got
            if status is None and present:
                continue  # its row is locked: next step
            if status in ("blocked", "waiting", "queued", "running"):
                done.extend(ids)  # marked: its end will be recorded by the trigger
                continue
            counted = conn.execute(Q["decide_children"], {"parent": parent}).fetchone()
            assert counted is not None
            seen, locked, n, _ = counted
            decided += int(n)
            if locked == seen:
                done.extend(ids)
        if done:
            conn.execute(Q["done_ended"], {"ids": done})
        if decided:
            log.event("runs_decided", runs=decided, parents=len(by_parent))
        return len(done)


class DepsStage:
    name = "deps"
    wakes: frozenset[str] = frozenset({WAKE})

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit

    def step(self, site: Site) -> int:
        with site.conns.pooled() as conn:
            return settle(conn, self.limit)

    def next_due(self, site: Site) -> float | None:
        """Nothing is due until a NOTIFY names this stage (a parent ended, an enqueue waits)."""
        return None
