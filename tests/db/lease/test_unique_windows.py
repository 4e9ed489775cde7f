"""Unique windows (`unique_for=`): an enqueue of a key whose window run was enqueued less than
unique_for ago, and did not fail or get cancelled, returns that run, finished or not; a window is
its tenant's; the task's window is every enqueue's unless one says; from Python (sync, async,
enqueue_many), SQL and the CLI. Time moves with the database clock, never by sleeping."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from leasework import App, Client, ConfigError, Enqueued, KindDefaults
from leasework.cli import render_run
from leasework.leases import lease

from ...conftest import get_run, shift_clock
from ..checks import KINDS, LEASE, TENANTS, make_app, unique_window_holds_finished_runs

Conn = psycopg.Connection[Any]


def finish(conn: Conn, run_id: int, status: str = "succeeded") -> None:
    claims = lease.claim_runs(conn, KINDS, worker="w", lease=LEASE, limit=1)
    assert [c.id for c in claims] == [run_id]
    assert lease.finish(conn, claims[0], status, error=None if status == "succeeded" else "x")


@pytest.mark.parametrize("tenant", TENANTS)
def test_a_window_run_holds_its_key_queued_running_and_finished(
    conn: Conn, tenant: str | None
) -> None:
    unique_window_holds_finished_runs(conn, tenant=tenant)


@pytest.mark.parametrize(
    ("ended", "holds"),
    [("succeeded", True), ("partial", True), ("failed", False), ("cancelled", False)],
)
def test_which_finished_runs_hold_their_window(conn: Conn, ended: str, holds: bool) -> None:
    """Finished runs count, as in Oban's unique periods: succeeded and partial ones hold the
    window; one that failed or was cancelled did not do its work, and a new run is made."""
    app = make_app()
    first = app.enqueue(conn, "job", key="acct-7", unique_for=3600)
    if ended == "cancelled":
        assert app.cancel(conn, first) == "cancelled"
    else:
        finish(conn, first, ended)
    shift_clock(conn, 3500)
    again = app.enqueue_run(conn, "job", key="acct-7", unique_for=3600)
    assert (again.run_id == first) is holds, (ended, again)
    assert again.how == ("window" if holds else None)
    marked = conn.execute("SELECT id FROM leasework.runs WHERE unique_at IS NOT NULL").fetchall()
    assert marked == [(again.run_id,)]  # one window run per key: the new one took the mark


def test_the_window_is_measured_from_the_runs_enqueue_in_database_time(conn: Conn) -> None:
    """Sliding from the window run's enqueue (not aligned to the clock): just inside, the run;
    just past, a new one, whose own window then starts."""
    app = make_app()
    first = app.enqueue(conn, "job", key="acct-7", unique_for=600)
    finish(conn, first)
    shift_clock(conn, 590)
    assert app.enqueue(conn, "job", key="acct-7", unique_for=600) == first
    shift_clock(conn, 610)
    second = app.enqueue(conn, "job", key="acct-7", unique_for=600)
    assert second != first
    finish(conn, second)
    shift_clock(conn, 610 + 590)
    assert app.enqueue(conn, "job", key="acct-7", unique_for=600) == second
    shift_clock(conn, 610 + 610)
    assert app.enqueue(conn, "job", key="acct-7", unique_for=600) not in (first, second)


def test_an_active_run_past_its_window_is_still_the_keys(conn: Conn) -> None:
    """A window run still queued (a delay) or running when its window is over is returned by the
    key rule: one active run per key."""
    app = make_app()
    first = app.enqueue(conn, "job", key="k", unique_for=60, delay=3600)
    shift_clock(conn, 120)
    assert app.enqueue_run(conn, "job", key="k", unique_for=60) == Enqueued(first, True)
    assert app.enqueue_run(conn, "job", key="k", unique_for=60).how == "active"


def test_a_window_is_its_tenants(conn: Conn) -> None:
    """Tenant b's enqueue of a key whose window tenant a holds makes b's own run; runs without a
    tenant are a namespace of their own; each holds its own window once finished."""
    app = make_app()
    a = app.enqueue(conn, "job", key="report", tenant="a", unique_for=3600)
    b = app.enqueue(conn, "job", key="report", tenant="b", unique_for=3600)
    none = app.enqueue(conn, "job", key="report", unique_for=3600)
    assert len({a, b, none}) == 3, "a tenant's enqueue returned another tenant's window run"
    for run_id in (a, b, none):
        finish(conn, run_id)
    shift_clock(conn, 1800)
    assert app.enqueue(conn, "job", key="report", tenant="a", unique_for=3600) == a
    assert app.enqueue(conn, "job", key="report", tenant="b", unique_for=3600) == b
    assert app.enqueue(conn, "job", key="report", unique_for=3600) == none
    assert app.enqueue(conn, "job", key="report", tenant="c", unique_for=3600) not in (a, b, none)


def test_an_enqueue_without_unique_for_is_the_key_rule_alone(conn: Conn) -> None:
    """Windows are opt-in per enqueue (as Oban's unique option): a plain enqueue of a key whose
    window run finished makes a run, which holds no window."""
    app = make_app()
    first = app.enqueue(conn, "job", key="k", unique_for=3600)
    finish(conn, first)
    plain = app.enqueue(conn, "job", key="k")
    assert plain != first and get_run(conn, plain)["unique_at"] is None
    finish(conn, plain)
    assert app.enqueue(conn, "job", key="k", unique_for=3600) == first


def test_the_tasks_window_needs_a_key_in_every_enqueue(conn: Conn) -> None:
    """`@app.task(kind, unique_for=)` (and a Client's KindDefaults) applies to each enqueue of
    the kind, which then needs a key: refused in one line naming the task's option, nothing
    written; an enqueue that turns it off needs none."""
    app = App()
    app.task("report", unique_for=3600)(lambda ctx, payload: None)
    client = Client(kinds={"report": KindDefaults(unique_for=3600)})
    for enqueuer in (app, client):
        with pytest.raises(ConfigError) as refused:
            enqueuer.enqueue(conn, "report", {})
        line = str(refused.value)
        assert line.startswith("unique_for needs a key") and "\n" not in line, line
        assert "task 'report' has unique_for=3600" in line and "unique_for=None" in line, line
        with pytest.raises(ConfigError, match="unique_for needs a key"):
            enqueuer.enqueue_many(conn, "report", [{}])
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (0,)
    assert app.enqueue_run(conn, "report", {}, unique_for=None).existing is False


def test_task_defaults_apply_and_an_enqueue_overrides_them(conn: Conn) -> None:
    app = App()
    app.task("report", unique_for=3600)(lambda ctx, payload: None)
    first = app.enqueue(conn, "report", key="acct-7")
    finish_kind(conn, "report", first)
    assert app.enqueue(conn, "report", key="acct-7") == first, (
        "the task's unique_for was not applied"
    )
    assert app.enqueue(conn, "report", key="acct-7", unique_for=None) != first  # off for it
    second = app.enqueue_run(conn, "report", key="acct-8")
    assert not second.existing and get_run(conn, second.run_id)["unique_at"] is not None


def finish_kind(conn: Conn, kind: str, run_id: int) -> None:
    claims = lease.claim_runs(conn, [kind], worker="w", lease=LEASE, limit=1)
    assert [c.id for c in claims] == [run_id]
    assert lease.finish(conn, claims[0], "succeeded")


def test_sql_enqueue_takes_unique_for(conn: Conn) -> None:
    """leasework.enqueue(..., unique_for => s): the same rule from SQL; the finished run is
    returned inside the window, a new one after it."""

    def sql_enqueue() -> int:
        found = conn.execute(
            "SELECT leasework.enqueue('job', '{\"n\": 1}', key => 'acct-7', tenant => 'ws',"
            " unique_for => 3600)"
        ).fetchone()
        assert found is not None
        return int(found[0])

    first = sql_enqueue()
    assert sql_enqueue() == first
    finish(conn, first)
    assert sql_enqueue() == first
    shift_clock(conn, 3601)
    assert sql_enqueue() != first
    # The Python path sees the SQL path's window: one rule.
    assert make_app().enqueue(conn, "job", key="acct-7", tenant="ws", unique_for=3600) != first


def test_enqueue_many_with_unique_for_returns_the_runs_it_made(conn: Conn) -> None:
    """Each payload's key is held to the rule in payload order (a key twice in one call makes one
    run); the ids returned are those of the runs made, as for keys=."""
    app = make_app()
    made = app.enqueue_many(
        conn, "job", [{"n": 1}, {"n": 2}, {"n": 3}], keys=["a", "b", "a"], unique_for=3600
    )
    assert len(made) == 2
    rows = conn.execute("SELECT key, payload FROM leasework.runs ORDER BY id").fetchall()
    assert rows == [("a", {"n": 1}), ("b", {"n": 2})]
    for run_id in made:
        finish(conn, run_id)
    assert app.enqueue_many(conn, "job", [{"n": 4}], keys=["a"], unique_for=3600) == []
    shift_clock(conn, 3601)
    assert len(app.enqueue_many(conn, "job", [{"n": 5}], keys=["a"], unique_for=3600)) == 1
    with pytest.raises(ConfigError, match=r"unique_for needs a key.*payload 1 has none"):
        app.enqueue_many(conn, "job", [{}, {}], keys=["a", None], unique_for=60)
    with pytest.raises(ConfigError, match=r"unique_for needs a key.*keys=\[\.\.\.\]"):
        app.enqueue_many(conn, "job", [{}], unique_for=60)


def test_the_async_enqueue_takes_unique_for(conn: Conn, dsn: str) -> None:
    app = make_app()

    async def go() -> tuple[int, int]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            one = await app.enqueue_async(aconn, "job", key="k", unique_for=3600)
            many = await app.enqueue_many_async(aconn, "job", [{}], keys=["k"], unique_for=3600)
            assert many == []
            return one, await app.enqueue_async(aconn, "job", key="k", unique_for=3600)

    first, again = asyncio.run(go())
    assert first == again
    finish(conn, first)
    assert app.enqueue(conn, "job", key="k", unique_for=3600) == first


def test_show_says_a_run_holds_a_unique_window(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job", key="acct-7", unique_for=3600)
    text = render_run(get_run(conn, run_id), conn.execute("SELECT now()").fetchone()[0])  # type: ignore[index]
    assert "window:" in text and "unique window opened" in text
    plain = app.enqueue(conn, "job", key="other")
    text = render_run(get_run(conn, plain), conn.execute("SELECT now()").fetchone()[0])  # type: ignore[index]
    assert "window:" not in text and "debounce:" not in text


@pytest.mark.parametrize("earlier", [False, True], ids=["first-window", "window-taken-over"])
def test_under_repeatable_read_a_racing_enqueue_fails_rather_than_make_a_second_run(
    conn: Conn, dsn: str, earlier: bool
) -> None:
    """An enqueue whose REPEATABLE READ snapshot predates another enqueue's window run (which
    then even finished) cannot see that run; it gets a serialization error to retry, not a
    second run in the window: it meets that run's mark in runs_one_window_per_key, or (when an
    older window run gave its mark up) that run's row, updated since its snapshot."""
    app = make_app()
    if earlier:
        old = app.enqueue(conn, "job", key="acct-7", unique_for=60)
        finish(conn, old)
        shift_clock(conn, 120)
    with psycopg.connect(dsn) as late:
        late.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        shift_clock(late, 120 if earlier else 0)  # its transaction's snapshot, taken now
        first = app.enqueue(conn, "job", key="acct-7", unique_for=60)
        finish(conn, first)
        with pytest.raises(psycopg.errors.SerializationFailure):
            app.enqueue(late, "job", key="acct-7", unique_for=60)
        late.rollback()
        assert app.enqueue(late, "job", key="acct-7", unique_for=60) == first  # the retry
    count = conn.execute("SELECT count(*) FROM leasework.runs").fetchone()
    assert count == (2 if earlier else 1,)
