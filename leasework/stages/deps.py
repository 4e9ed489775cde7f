"""The `deps` stage: decides the runs that wait for others (docs/workflows.md). A run that
something waits for records its end in `leasework.run_deps_ended` (the trigger runs_ended,
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
# by runs_ended, and by an enqueue after a run it did not make (schema.sql).
WAKE = "leasework:deps"


# Parents a step takes from the inbox at most; each parent's blocked children are decided in
# its transaction, however many.
LIMIT = 100

ENDED = ("succeeded", "partial", "failed", "cancelled")


def settle(conn: Conn, limit: int, skipped: list[int] | None = None) -> int:
    """One bounded step: up to `limit` parents taken from the inbox, each in a transaction of
    its own (a running parent's row, when it is marked, is locked only for that short
    transaction): marked if need be and, once ended, its blocked children locked, then decided
    by a statement whose snapshot follows the locks; its inbox rows deleted unless a row lock
    someone held left it (or one of its children) undecided. Returns how many parents were
    handled; `skipped` gets the parents left for the next step."""
    if skipped is None:
        skipped = []
    skipped.clear()
    handled = decided = 0
    while handled + len(skipped) < limit:
        with conn.transaction():
            got = conn.execute(Q["take_parent"], {"skipped": skipped}).fetchone()
            if got is None:
                break
            parent, ids, status, marked, present = got
            if present and not marked:
                row = conn.execute(Q["mark_parent"], {"parent": parent}).fetchone()
                if row is None:  # its row is locked: next step
                    skipped.append(parent)
                    continue
                status = row[0]
            if present and status not in ENDED:
                conn.execute(Q["done_ended"], {"ids": ids})  # marked: its end records itself
                handled += 1
                continue
            # Locked in one statement, decided in the next: its snapshot, taken after the
            # locks, reads every edge committed before them (a run joining a batch, deps.sql).
            children = conn.execute(Q["lock_children"], {"parent": parent}).fetchone()
            assert children is not None
            seen, kids = children
            if kids:
                counted = conn.execute(Q["decide_children"], {"kids": kids}).fetchone()
                assert counted is not None
                decided += int(counted[0])
            if len(kids) == seen:
                conn.execute(Q["done_ended"], {"ids": ids})
                handled += 1
            else:  # a child someone holds: this parent's rows stay for the next step
                skipped.append(parent)
    if decided:
        log.event("runs_decided", runs=decided, parents=handled)
    return handled


class DepsStage:
    name = "deps"
    wakes: frozenset[str] = frozenset({WAKE})

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._skipped: list[int] = []  # parents the last step left: a row lock someone held

    def step(self, site: Site) -> int:
        with site.conns.pooled() as conn:
            return settle(conn, self.limit, self._skipped)

    def next_due(self, site: Site) -> float | None:
        """Nothing is due until a NOTIFY names this stage (a parent ended, an enqueue waits),
        unless the last step left a parent whose row, or a child's, someone held: then at the
        next poll (0: unknown)."""
        return 0.0 if self._skipped else None
