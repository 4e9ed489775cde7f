"""The suite must be able to fail: load lease.sql, break one rule on purpose (a renewal without
its owner predicate, a claim that ignores cancel requests), and show that the invariant checks
that pass on the real query fail on the mutant."""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import Any

import psycopg
import pytest
from psycopg import sql

from leasework.queries import parse
from leasework.workers import lease

from ..conftest import truncate_all
from .checks import cancel_beats_reclaim, stale_owner_writes_nothing

Conn = psycopg.Connection[Any]


def original(name: str) -> str:
    text = resources.files("leasework.workers").joinpath("lease.sql").read_text(encoding="utf-8")
    return parse(text)[name]


def mutate(name: str, remove: str, replace: str = "") -> Any:
    """The named query with every `remove` replaced, in the type lease.Q holds."""
    body = original(name)
    assert remove in body, f"the mutation no longer applies to {name}: update this test"
    mutant = body.replace(remove, replace)
    current = lease.Q[name]
    return mutant.encode() if isinstance(current, bytes) else sql.SQL(mutant)


RENEW_WITHOUT_OWNER = ("renew_lease", " AND lease_owner = %(owner)s", "")
CLAIM_IGNORES_CANCEL = ("claim_runs", "AND r.cancel_requested_at IS NULL ", "")
BATCH_FINISH_WITHOUT_OWNER = ("finish_runs", "AND r.lease_owner = d.owner", "")


def fails_with(
    monkeypatch: pytest.MonkeyPatch,
    conn: Conn,
    mutation: tuple[str, str, str],
    check: Callable[[Conn], None],
) -> AssertionError:
    check(conn)  # passes on the real query
    truncate_all(conn)
    with monkeypatch.context() as m:
        m.setitem(lease.Q, mutation[0], mutate(*mutation))
        with pytest.raises(AssertionError) as caught:
            check(conn)
    truncate_all(conn)
    check(conn)  # and passes again once the real query is back
    return caught.value


def test_renewal_without_owner_predicate_is_caught(
    monkeypatch: pytest.MonkeyPatch, conn: Conn
) -> None:
    fails_with(monkeypatch, conn, RENEW_WITHOUT_OWNER, stale_owner_writes_nothing)


def test_claim_ignoring_cancel_requests_is_caught(
    monkeypatch: pytest.MonkeyPatch, conn: Conn
) -> None:
    err = fails_with(monkeypatch, conn, CLAIM_IGNORES_CANCEL, cancel_beats_reclaim)
    assert "cancel request" in str(err)


def test_batch_finish_without_owner_predicate_is_caught(
    monkeypatch: pytest.MonkeyPatch, conn: Conn
) -> None:
    fails_with(monkeypatch, conn, BATCH_FINISH_WITHOUT_OWNER, stale_owner_writes_nothing)
