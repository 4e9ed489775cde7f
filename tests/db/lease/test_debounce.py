"""Debounce (`debounce=`, `debounce_max=`, `debounce_merge=`): an enqueue of a key whose
debounced run of the kind is still pending (queued, or waiting behind the key's running run)
replaces its payload, or merges old and new by the task's function, and makes it due debounce
seconds from now, never later than its first enqueue + debounce_max; with the key's run running,
a new run waits behind it so no edit is lost. Time moves with the database clock."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from leasework import App, ConfigError, Enqueued
from leasework.cli import render_run
from leasework.leases import lease

from ...conftest import fast_config, get_run, shift_clock
from ..checks import (
    KINDS,
    LEASE,
    TENANTS,
    debounce_merge_keeps_a_racing_merge,
    make_app,
    merge_union,
)

Conn = psycopg.Connection[Any]


def now(conn: Conn) -> Any:
    row = conn.execute("SELECT leasework.now()").fetchone()
    assert row is not None
    return row[0]


def due_in(conn: Conn, run_id: int) -> float:
    """Seconds from the database's now until the run is due."""
    return float((get_run(conn, run_id)["queued_at"] - now(conn)).total_seconds())


def claim(conn: Conn, kinds: list[str] | None = None) -> lease.Claim:
    claims = lease.claim_runs(conn, kinds or KINDS, worker="w", lease=LEASE, limit=1)
    assert len(claims) == 1, "nothing was claimed"
    return claims[0]


@pytest.mark.parametrize("tenant", TENANTS)
def test_an_enqueue_replaces_the_pending_runs_payload_and_moves_its_due_time(
    conn: Conn, tenant: str | None
) -> None:
    app = make_app()
    first = app.enqueue_run(conn, "job", {"v": 1}, key="doc-7", tenant=tenant, debounce=30)
    assert not first.existing and 29 < due_in(conn, first.run_id) <= 30
    shift_clock(conn, 20)
    again = app.enqueue_run(conn, "job", {"v": 2}, key="doc-7", tenant=tenant, debounce=30)
    assert again == Enqueued(first.run_id, True) and again.how == "debounced"
    row = get_run(conn, first.run_id)
    assert row["payload"] == {"v": 2} and row["debounce_count"] == 2
    assert 29 < due_in(conn, first.run_id) <= 30, "the due time did not move to now + debounce"
    assert lease.claim_runs(conn, KINDS, worker="w", lease=LEASE) == [], "claimed before due"
    shift_clock(conn, 51)
    assert claim(conn).id == first.run_id
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (1,)


def test_debounce_max_bounds_how_far_enqueues_postpone_the_run(conn: Conn) -> None:
    """Due debounce seconds after the last enqueue, but never later than the first enqueue +
    debounce_max: a steady stream of edits still runs."""
    app = make_app()
    run_id = app.enqueue(conn, "job", {"v": 0}, key="doc", debounce=30, debounce_max=60)
    deadline = get_run(conn, run_id)["debounce_deadline"]
    assert deadline is not None
    for step, at in enumerate((25, 50, 75, 100), start=1):
        shift_clock(conn, at)
        assert (
            app.enqueue(conn, "job", {"v": step}, key="doc", debounce=30, debounce_max=60) == run_id
        )
        row = get_run(conn, run_id)
        assert row["queued_at"] <= deadline, (
            f"postponed past first enqueue + debounce_max at {at} s"
        )
        assert row["payload"] == {"v": step}
    assert get_run(conn, run_id)["queued_at"] == deadline
    assert claim(conn).id == run_id  # at 100 s: due since 60 s, however many edits came
    assert get_run(conn, run_id)["debounce_count"] == 5


def test_an_enqueue_while_the_keys_run_is_running_makes_a_run_that_waits_behind_it(
    conn: Conn,
) -> None:
    """The running run keeps the payload it started with; the edit goes into a new debounced run
    that waits for the key (one run of a key at a time), takes the next edits, is promoted when
    the running run ends and is due at its own debounce time."""
    app = make_app()
    first = app.enqueue(conn, "job", {"v": 1}, key="doc", debounce=30)
    shift_clock(conn, 31)
    running = claim(conn)
    assert running.id == first
    follow = app.enqueue_run(conn, "job", {"v": 2}, key="doc", debounce=30)
    assert not follow.existing and follow.run_id != first
    assert get_run(conn, follow.run_id)["status"] == "waiting"
    assert app.enqueue(conn, "job", {"v": 3}, key="doc", debounce=30) == follow.run_id
    row = get_run(conn, follow.run_id)
    assert row["payload"] == {"v": 3} and row["debounce_count"] == 2
    assert get_run(conn, first)["payload"] == {"v": 1}
    assert lease.expire_and_promote(conn, 100) == (0, 0), "promoted while the key's run runs"
    assert lease.finish(conn, running, "succeeded")
    assert lease.expire_and_promote(conn, 100) == (0, 1)
    promoted = get_run(conn, follow.run_id)
    assert promoted["status"] == "queued" and 29 < due_in(conn, follow.run_id) <= 30
    # Queued again, it takes the next edit in place.
    assert app.enqueue(conn, "job", {"v": 4}, key="doc", debounce=30) == follow.run_id
    shift_clock(conn, 31 + 31)
    assert claim(conn).id == follow.run_id
    assert get_run(conn, follow.run_id)["payload"] == {"v": 4}


def test_a_merge_function_combines_old_and_new_payloads(conn: Conn) -> None:
    app = App()
    app.task("reindex", debounce=30, debounce_merge=merge_union)(lambda ctx, payload: None)
    run_id = app.enqueue(conn, "reindex", {"items": [3]}, key="doc")
    for item in (1, 3, 2):
        assert app.enqueue(conn, "reindex", {"items": [item]}, key="doc") == run_id
    row = get_run(conn, run_id)
    assert row["payload"] == {"items": [1, 2, 3]}, f"the merge was not applied: {row['payload']}"
    assert row["debounce_count"] == 4
    # The merge is the task's unless an enqueue says: replace for this one.
    assert app.enqueue(conn, "reindex", {"items": [9]}, key="doc", debounce_merge=None) == run_id
    assert get_run(conn, run_id)["payload"] == {"items": [9]}


def test_a_racing_merge_is_merged_again_not_written_over(conn: Conn) -> None:
    debounce_merge_keeps_a_racing_merge(conn)


def test_a_merge_whose_run_was_claimed_meanwhile_makes_a_new_run(conn: Conn, dsn: str) -> None:
    """The read-modify-write of a merge: here the pending run is claimed by another worker while
    the merge function runs (no transaction of the caller's: the read's lock ended with it).
    The write finds the run no longer pending and writes nothing to it; the enqueue reads again,
    finds none pending, and the edit goes into a new run waiting behind the claimed one."""
    app = make_app()
    run_id = app.enqueue(conn, "job", {"items": [1]}, key="doc", debounce=30)
    claimed: list[lease.Claim] = []

    def merge(old: Any, new: Any) -> Any:
        if not claimed:
            with psycopg.connect(dsn, autocommit=True) as other:
                shift_clock(other, 31)
                claimed.append(claim(other))
        return merge_union(old, new)

    done = app.enqueue_run(
        conn, "job", {"items": [2]}, key="doc", debounce=30, debounce_merge=merge
    )
    assert claimed and claimed[0].id == run_id
    assert done.run_id != run_id and not done.existing
    assert get_run(conn, run_id)["payload"] == {"items": [1]}, "the claimed run's payload changed"
    new = get_run(conn, done.run_id)
    assert new["status"] == "waiting" and new["payload"] == {"items": [2]}


def test_a_merge_inside_a_transaction_holds_the_pending_run_until_commit(
    conn: Conn, dsn: str
) -> None:
    """Inside the caller's transaction the pending run stays locked from the read to the commit:
    a claim meanwhile passes it by (SKIP LOCKED) instead of taking it half-merged."""
    app = make_app()
    run_id = app.enqueue(conn, "job", {"items": [1]}, key="doc", debounce=30)
    with psycopg.connect(dsn, autocommit=True) as other:
        shift_clock(other, 31)
        with conn.transaction():
            assert (
                app.enqueue(
                    conn, "job", {"items": [2]}, key="doc", debounce=30, debounce_merge=merge_union
                )
                == run_id
            )
            assert lease.claim_runs(other, KINDS, worker="w", lease=LEASE) == []
        shift_clock(other, 61)
        assert claim(other).id == run_id
    assert get_run(conn, run_id)["payload"] == {"items": [1, 2]}


def test_a_pending_run_not_made_by_a_debounce_is_the_key_rule(conn: Conn) -> None:
    """Debounce merges only into a pending run that a debounce of the same kind made: a run of
    the key enqueued without debounce, or of another kind, is returned as it is (the key rule)."""
    app = make_app()
    plain = app.enqueue(conn, "job", {"v": 1}, key="doc")
    done = app.enqueue_run(conn, "job", {"v": 2}, key="doc", debounce=30)
    assert done == Enqueued(plain, True) and done.how == "active"
    assert get_run(conn, plain)["payload"] == {"v": 1}
    assert app.cancel(conn, plain) == "cancelled"
    other_kind = app.enqueue(conn, "other", {"v": 1}, key="doc", debounce=30)
    assert app.enqueue_run(conn, "job", {"v": 2}, key="doc", debounce=30).how == "active"
    assert get_run(conn, other_kind)["payload"] == {"v": 1}


def test_debounce_is_per_tenant(conn: Conn) -> None:
    app = make_app()
    a = app.enqueue(conn, "job", {"v": "a"}, key="doc", tenant="a", debounce=30)
    b = app.enqueue(conn, "job", {"v": "b"}, key="doc", tenant="b", debounce=30)
    none = app.enqueue(conn, "job", {"v": "-"}, key="doc", debounce=30)
    assert len({a, b, none}) == 3
    assert app.enqueue(conn, "job", {"v": "b2"}, key="doc", tenant="b", debounce=30) == b
    payloads = dict(conn.execute("SELECT id, payload FROM leasework.runs").fetchall())
    assert payloads == {a: {"v": "a"}, b: {"v": "b2"}, none: {"v": "-"}}


def test_sql_enqueue_takes_debounce(conn: Conn) -> None:
    """leasework.enqueue(..., debounce => s, debounce_max => s): replace, from SQL."""

    def sql_enqueue(v: int) -> int:
        found = conn.execute(
            "SELECT leasework.enqueue('job', jsonb_build_object('v', %s::int), key => 'doc',"
            " debounce => 30, debounce_max => 45)",
            (v,),
        ).fetchone()
        assert found is not None
        return int(found[0])

    first = sql_enqueue(1)
    shift_clock(conn, 20)
    assert sql_enqueue(2) == first
    row = get_run(conn, first)
    assert row["payload"] == {"v": 2} and row["debounce_count"] == 2
    assert 24 < due_in(conn, first) <= 25, "not bounded by first enqueue + debounce_max"


def test_enqueue_many_with_debounce(conn: Conn) -> None:
    """Payloads of one key in one call coalesce as separate enqueues would, replaced or merged;
    the ids returned are those of the runs made."""
    app = make_app()
    made = app.enqueue_many(
        conn,
        "job",
        [{"items": [1]}, {"items": [2]}, {"items": [3]}],
        keys=["a", "b", "a"],
        debounce=30,
    )
    assert len(made) == 2
    assert [get_run(conn, i)["payload"] for i in made] == [{"items": [3]}, {"items": [2]}]
    more = app.enqueue_many(
        conn,
        "job",
        [{"items": [4]}, {"items": [5]}],
        keys=["a", "a"],
        debounce=30,
        debounce_merge=merge_union,
    )
    assert more == []
    assert get_run(conn, made[0])["payload"] == {"items": [3, 4, 5]}


def test_a_merge_that_gives_no_json_or_too_much_writes_nothing(conn: Conn) -> None:
    """What a merge function returns is checked as a payload is, before anything is written."""
    app = App(fast_config(conn.info.dsn, payload_max_bytes=1024))
    app.task("job")(lambda ctx, payload: None)
    run_id = app.enqueue(conn, "job", {"v": 1}, key="doc", debounce=30)
    for merge, says in [
        (lambda old, new: {1, 2}, "payload is not JSON-serializable"),
        (lambda old, new: {"v": "x" * 2000}, "over the cap of 1024 bytes"),
    ]:
        with pytest.raises(ConfigError, match=says):
            app.enqueue(conn, "job", {"v": 2}, key="doc", debounce=30, debounce_merge=merge)
    row = get_run(conn, run_id)
    assert row["payload"] == {"v": 1} and row["debounce_count"] == 1


def test_show_says_a_run_is_debounced(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job", {"v": 1}, key="doc", debounce=30, debounce_max=300)
    app.enqueue(conn, "job", {"v": 2}, key="doc", debounce=30, debounce_max=300)
    text = render_run(get_run(conn, run_id), now(conn))
    line = next(x for x in text.splitlines() if x.startswith("debounce:"))
    assert "2 enqueues merged; due " in line and "at the latest " in line, line
    running = claim_after(conn, 31)
    follow = app.enqueue(conn, "job", {"v": 3}, key="doc", debounce=30)
    assert running.id == run_id
    text = render_run(get_run(conn, follow), now(conn))
    assert "never bounded; waits for its key's running run to end" in text, text


def claim_after(conn: Conn, seconds: float) -> lease.Claim:
    shift_clock(conn, seconds)
    try:
        return claim(conn)
    finally:
        shift_clock(conn, 0)


def test_due_time_moving_sooner_wakes_idle_workers(conn: Conn, dsn: str) -> None:
    """A merge that makes the run due sooner than it was sends a NOTIFY (idle workers sleep until
    the next due time they read); one that postpones it sends none."""
    app = make_app()
    run_id = app.enqueue(conn, "job", key="doc", debounce=300)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN leasework")
        app.enqueue(conn, "job", key="doc", debounce=300)  # later than before: no NOTIFY
        app.enqueue(conn, "job", key="doc", debounce=10)  # sooner: NOTIFY
        conn.execute("NOTIFY leasework, 'end'")  # delivered after the enqueues' (one session)
        heard: list[str] = []
        for note in listener.notifies(timeout=30):
            heard.append(note.payload)
            if note.payload == "end":
                break
    assert heard == ["job", "end"], heard
    assert due_in(conn, run_id) <= 10


def test_an_enqueue_that_clashes_with_its_tasks_windows_says_so(conn: Conn) -> None:
    """An enqueue's own window over the task's: a clash names the task's option, and turning
    the task's off first is fine."""
    app = App()
    app.task("reindex", debounce=30, debounce_max=60)(lambda ctx, payload: None)
    with pytest.raises(ConfigError) as clash:
        app.enqueue(conn, "reindex", key="k", unique_for=60)
    assert str(clash.value) == (
        "unique_for and debounce cannot be combined: a unique window keeps the key's run as it "
        "is, a debounce changes it; give one of them (task 'reindex' has debounce=30, "
        "debounce_max=60)"
    )
    with pytest.raises(ConfigError, match="exclusive cannot be combined with debounce"):
        app.enqueue(conn, "reindex", key="k", exclusive=True)
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (0,)
    assert app.enqueue_run(conn, "reindex", key="k", debounce=None, unique_for=60).how is None
