"""The runs a run waited for, as its handler reads them (`ctx.parents()`, docs/workflows.md):
read with one statement when asked, never at the claim."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..queries import load

Q = load("leasework.workers", "parents.sql")
QUERY = Q["parents"]

ENDED = ("succeeded", "partial", "failed", "cancelled")


@dataclass(frozen=True)
class Parent:
    """One run this run waited for: its id, kind, final status, result (None unless it returned
    one) and error; `member`: a member of the batch whose callback this run is."""

    id: int
    kind: str
    status: str
    result: Any
    error: str | None
    member: bool = False


class Parents(list[Parent]):
    """The parents, by id. `counts`: how many of the batch's members ended in each status (every
    status present, 0 when none), for a batch's callback; all zero for any other run."""

    @property
    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(ENDED, 0)
        for p in self:
            if p.member:
                counts[p.status] = counts.get(p.status, 0) + 1
        return counts

    @property
    def members(self) -> list[Parent]:
        """The batch's members (a batch's callback): the parents but the run that opened it."""
        return [p for p in self if p.member]

    def results(self) -> dict[int, Any]:
        """{parent id: its result}."""
        return {p.id: p.result for p in self}


def parents_of(rows: Iterable[Any]) -> Parents:
    return Parents(Parent(int(r[0]), r[1], r[2], r[3], r[4], bool(r[5])) for r in rows)
