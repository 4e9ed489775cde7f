"""A success is recorded by the row, not by an entry of runs.history (issue 19: the entry was a
sixth of a one-at-a-time job's WAL). Every statement that seals a success keeps lease_worker and
appends nothing; leasework.run_history() gives the history with the success's entry, and every
reader shows that one. A run sealed before (its entry written) gets no second entry."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from leasework import App, operations
from leasework.leases import lease

from ...conftest import expire_lease

Conn = psycopg.Connection[Any]


def stored(conn: Conn, run_id: int) -> dict[str, Any]:
    row = conn.execute(
        "SELECT status, lease_worker, lease_owner, history, attempts, started_at, finished_at"
        "  FROM leasework.runs WHERE id = %s",
        (run_id,),
    ).fetchone()
    assert row is not None
    keys = ("status", "worker", "owner", "history", "attempts", "started_at", "finished_at")
    return dict(zip(keys, row, strict=True))


def claim(conn: Conn, worker: str = "w1") -> lease.Claim:
    (c,) = lease.claim_runs(conn, ["k"], worker=worker, lease=30.0)
    return c


def enqueue(conn: Conn, n: int) -> list[int]:
    app = App()
    app.task("k")(lambda ctx, p: None)
    return [app.enqueue(conn, "k", {"i": i}) for i in range(n)]


def seal_finish(conn: Conn, c: lease.Claim) -> None:
    assert lease.finish(conn, c, "succeeded", result={"ok": 1})


def seal_many(conn: Conn, c: lease.Claim) -> None:
    assert lease.finish_many(conn, [(c, None)]) == {c.id}


def seal_whole(conn: Conn, c: lease.Claim) -> None:
    sealed, _ = lease.finish_and_claim(conn, c, ["k"], worker="w1", lease=30.0)
    assert sealed


def seal_quick(conn: Conn, c: lease.Claim) -> None:
    sealed, _ = lease.finish_and_claim(conn, c, ["k"], worker="w1", lease=30.0, chain=lease.Chain())
    assert sealed


@pytest.mark.parametrize("seal", [seal_finish, seal_many, seal_whole, seal_quick])
def test_a_success_appends_no_entry_and_every_reader_shows_one(conn: Conn, seal: Any) -> None:
    run_id, _ = enqueue(conn, 2)
    c = claim(conn, worker="host-1:42:abc")

    seal(conn, c)

    row = stored(conn, run_id)
    assert row["status"] == "succeeded" and row["history"] == []
    assert row["worker"] == "host-1:42:abc" and row["owner"] is None
    expected = {
        "attempt": 1,
        "owner": None,
        "worker": "host-1:42:abc",
        "outcome": "succeeded",
        "error": None,
    }
    shown = [operations.get_run(conn, run_id), App().get_run(conn, run_id)]
    for run in shown:
        assert run is not None
        (entry,) = run["history"]
        assert {k: entry[k] for k in expected} == expected
        assert entry["started_at"] is not None and entry["ended_at"] is not None


def test_a_success_after_a_lost_attempt_is_shown_after_its_entry(conn: Conn) -> None:
    (run_id,) = enqueue(conn, 1)
    first = claim(conn, worker="w-dead")
    expire_lease(conn, run_id)
    second = claim(conn, worker="w-alive")
    assert second.id == first.id and second.attempts == 2

    seal_finish(conn, second)

    run = operations.get_run(conn, run_id)
    assert run is not None
    assert [(h["attempt"], h["outcome"], h["worker"]) for h in run["history"]] == [
        (1, "expired", "w-dead"),
        (2, "succeeded", "w-alive"),
    ]


def test_a_run_sealed_with_its_entry_gets_no_second_one(conn: Conn) -> None:
    # Sealed by a worker of an earlier version, which wrote the success's entry itself.
    (run_id,) = enqueue(conn, 1)
    c = claim(conn)
    seal_finish(conn, c)
    conn.execute(
        "UPDATE leasework.runs SET history = jsonb_build_array(leasework.history_entry("
        " attempts, gen_random_uuid(), 'old', started_at, finished_at, 'succeeded', NULL))"
        " WHERE id = %s",
        (run_id,),
    )

    run = operations.get_run(conn, run_id)

    assert run is not None
    assert [(h["outcome"], h["worker"]) for h in run["history"]] == [("succeeded", "old")]


def test_other_endings_still_append_their_entry_and_clear_the_worker(conn: Conn) -> None:
    (run_id,) = enqueue(conn, 1)
    c = claim(conn)

    assert lease.finish(conn, c, "partial", error="half")

    row = stored(conn, run_id)
    assert row["worker"] is None
    assert [(h["outcome"], h["error"]) for h in row["history"]] == [("partial", "half")]
