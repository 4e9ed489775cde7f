"""A handler's Fail and Snooze through every path that runs handlers: one at a time (including
the success sealed with the next claim), batches, async handlers, leasework.testing; what a
Fail or a Snooze records, the snooze cap, a cancel that wins, a stale worker that writes
nothing, and the readers (`leasework show`, the dashboard's run page) showing the entries."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from leasework import App, Context, Fail, Snooze
from leasework.cli import render_run
from leasework.dashboard import pages
from leasework.leases import lease
from leasework.testing import Runner, drain, run_task
from leasework.workers.acontext import AsyncContext
from leasework.workers.worker import Worker

from ..conftest import expire_lease, get_run, make_due

Conn = psycopg.Connection[Any]
MakeWorker = Callable[..., Worker]


def secs(delta: timedelta) -> float:
    return delta.total_seconds()


def steal(dsn: str, run_id: int, kind: str = "job") -> lease.Claim:
    """Another worker reclaims the run, as if this one had been paused past its lease."""
    with psycopg.connect(dsn, autocommit=True) as c:
        expire_lease(c, run_id)
        claims = lease.claim_runs(c, [kind], worker="thief", lease=30.0)
    assert [cl.id for cl in claims] == [run_id]
    return claims[0]


# -- one at a time ------------------------------------------------------------------------------


def test_a_snooze_requeues_without_charging_an_attempt(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    seen: list[int] = []

    @app.task("job", max_attempts=1)
    def job(ctx: Context, payload: Any) -> str:
        seen.append(ctx.attempt)
        if len(seen) < 3:
            ctx.result = {"naps": len(seen)}
            raise Snooze(after=600, reason="the partner's window is closed")
        return "done"

    run_id = app.enqueue(conn, "job")
    worker = make_worker(app)
    for n in (1, 2):
        before = lease.db_now(conn)
        assert worker.poll() == 1
        row = get_run(conn, run_id)
        assert row["attempts"] == 0, f"snooze {n} charged an attempt ({row['attempts']})"
        assert row["status"] == "queued" and row["snoozes"] == n
        assert row["error"] is None, "a snooze is not a failure"
        assert row["result"] == {"naps": n}
        assert 600 <= secs(row["queued_at"] - before) <= 605
        entry = row["history"][-1]
        assert entry["outcome"] == "snoozed" and entry["attempt"] == 1
        assert entry["error"] == "the partner's window is closed" and entry["due_at"]
        assert worker.poll() == 0, "a snoozed run was claimed before it was due"
        make_due(conn, run_id)
    assert worker.poll() == 1
    row = get_run(conn, run_id)
    # Its only attempt, three times: max_attempts=1 was never used up.
    assert seen == [1, 1, 1]
    assert row["status"] == "succeeded" and row["attempts"] == 1 and row["result"] == "done"
    assert [h["outcome"] for h in row["history"]] == ["snoozed", "snoozed", "succeeded"]


def test_the_snooze_past_max_snoozes_ends_the_run_failed(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()

    @app.task("job", max_attempts=3)
    def job(ctx: Context, payload: Any) -> None:
        raise Snooze(after=0)

    run_id = app.enqueue(conn, "job")
    worker = make_worker(app, max_snoozes=3, runs_limit=1)
    for _ in range(10):
        if get_run(conn, run_id)["status"] != "queued":
            break
        worker.poll()
    row = get_run(conn, run_id)
    assert row["status"] == "failed" and row["snoozes"] == 3 and row["attempts"] == 1
    assert row["error"] == "snoozed too often: more than max_snoozes = 3 snoozes"
    assert [h["outcome"] for h in row["history"]] == ["snoozed"] * 3 + ["failed"]


@pytest.mark.parametrize(
    "after", [float("inf"), float("nan"), -1, 30 * 24 * 3600 + 1, True, "30", None]
)
def test_a_bad_snooze_is_an_ordinary_failure(
    conn: Conn, make_worker: MakeWorker, after: Any
) -> None:
    app = App()

    @app.task("job")
    def job(ctx: Context, payload: Any) -> None:
        raise Snooze(after=after)

    run_id = app.enqueue(conn, "job")
    make_worker(app).poll()
    row = get_run(conn, run_id)
    assert row["status"] == "queued" and row["attempts"] == 1 and row["snoozes"] is None
    assert row["error"].splitlines()[0] == (
        f"ValueError: Snooze(after={after!r}): after must be a number of seconds from 0 to "
        "2592000 (30 days)"
    )
    assert [h["outcome"] for h in row["history"]] == ["failed"]


def test_a_fail_with_attempts_left_ends_failed_without_a_retry(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    calls: list[int] = []

    @app.task("job", max_attempts=5)
    def job(ctx: Context, payload: Any) -> None:
        calls.append(ctx.attempt)
        ctx.result = {"looked_up": 42}
        raise Fail("record 42 was deleted")

    run_id = app.enqueue(conn, "job")
    worker = make_worker(app)
    assert worker.poll() == 1
    row = get_run(conn, run_id)
    assert row["status"] == "failed" and row["attempts"] == 1 and row["finished_at"]
    assert row["error"] == "Fail: record 42 was deleted"
    assert row["result"] == {"looked_up": 42}
    [entry] = row["history"]
    assert (entry["outcome"], entry["error"]) == ("failed", "Fail: record 42 was deleted")
    make_due(conn, run_id)
    expire_lease(conn, run_id)
    assert worker.poll() == 0 and calls == [1], "a failed run ran again"


def test_a_fail_records_its_cause_and_its_result(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()

    @app.task("job")
    def job(ctx: Context, payload: Any) -> None:
        try:
            {}["record-42"]
        except KeyError as exc:
            raise Fail("record 42 was deleted", result={"partial": [1, 2]}) from exc

    run_id = app.enqueue(conn, "job")
    make_worker(app).poll()
    row = get_run(conn, run_id)
    assert row["status"] == "failed" and row["result"] == {"partial": [1, 2]}
    first, second, *rest = row["error"].splitlines()
    assert first == "Fail: record 42 was deleted"
    assert second == "caused by KeyError: 'record-42'"
    assert any("job" in line for line in rest), "the cause's traceback tail"


def test_fail_and_snooze_ride_the_one_at_a_time_chain(conn: Conn, make_worker: MakeWorker) -> None:
    """One poll runs a queue of successes, snoozes and fails: each success is sealed with the
    next claim (finish_and_claim), and a snooze or a fail after one is written at once."""
    app = App()

    @app.task("job", max_attempts=3)
    def job(ctx: Context, payload: Any) -> str:
        if payload == "snooze":
            raise Snooze(3600)
        if payload == "fail":
            raise Fail("no")
        return "ok"

    plan = ["ok", "snooze", "ok", "fail", "ok", "ok", "snooze", "fail", "ok"]
    ids = [app.enqueue(conn, "job", p) for p in plan]
    assert make_worker(app, runs_limit=100).poll() == len(plan)
    for run_id, what in zip(ids, plan, strict=True):
        row = get_run(conn, run_id)
        want = {"ok": ("succeeded", 1), "snooze": ("queued", 0), "fail": ("failed", 1)}[what]
        assert (row["status"], row["attempts"]) == want, (what, row)
        assert row["lease_owner"] is None


@pytest.mark.parametrize("outcome", ["snooze", "fail"])
def test_a_cancel_requested_meanwhile_wins(
    conn: Conn, dsn: str, make_worker: MakeWorker, outcome: str
) -> None:
    """The cancel lands while the handler runs and it never checks: the write itself sees it."""
    app = App()

    @app.task("job")
    def job(ctx: Context, payload: Any) -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            assert app.cancel(c, ctx.run_id) == "running"
        if outcome == "snooze":
            raise Snooze(60)
        raise Fail("gone")

    run_id = app.enqueue(conn, "job")
    make_worker(app).poll()
    row = get_run(conn, run_id)
    assert row["status"] == "cancelled" and row["finished_at"] and row["lease_owner"] is None
    assert row["snoozes"] is None


@pytest.mark.parametrize("outcome", ["snooze", "fail"])
def test_a_stale_worker_writes_nothing(
    conn: Conn, dsn: str, make_worker: MakeWorker, outcome: str
) -> None:
    app = App()
    thief: list[lease.Claim] = []

    @app.task("job")
    def job(ctx: Context, payload: Any) -> None:
        thief.append(steal(dsn, ctx.run_id))
        if outcome == "snooze":
            raise Snooze(60, reason="stale")
        raise Fail("stale")

    run_id = app.enqueue(conn, "job")
    make_worker(app).poll()
    row = get_run(conn, run_id)
    assert row["status"] == "running" and row["lease_owner"] == thief[0].owner
    assert row["lease_worker"] == "thief" and row["attempts"] == 2
    assert row["error"] is None and row["snoozes"] is None
    assert [h["outcome"] for h in row["history"]] == ["expired"]


# -- batches and async handlers -------------------------------------------------------------------


def test_fail_and_snooze_in_a_batch(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()

    @app.task("short", batch=4, max_attempts=3)
    def short(ctx: Context, payload: Any) -> str:
        if payload == "snooze":
            raise Snooze(60, reason="later")
        if payload == "fail":
            raise Fail("bad record")
        return "ok"

    plan = ["ok", "snooze", "fail", "ok"]
    ids = [app.enqueue(conn, "short", p) for p in plan]
    assert make_worker(app, runs_limit=1).poll() == 4
    got = [(get_run(conn, i)["status"], get_run(conn, i)["attempts"]) for i in ids]
    assert got == [("succeeded", 1), ("queued", 0), ("failed", 1), ("succeeded", 1)]
    assert get_run(conn, ids[1])["history"][-1]["error"] == "later"
    assert get_run(conn, ids[2])["error"] == "Fail: bad record"


def test_fail_and_snooze_in_async_handlers(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()

    @app.task("io", concurrency=4, max_attempts=3)
    async def io(ctx: AsyncContext, payload: Any) -> str:
        await asyncio.sleep(0)
        if payload == "snooze":
            raise Snooze(60, reason="later")
        if payload == "fail":
            raise Fail("bad record")
        return "ok"

    plan = ["ok", "snooze", "fail"]
    ids = [app.enqueue(conn, "io", p) for p in plan]
    worker = make_worker(app)
    assert worker.asynchronous
    worker.poll()
    got = [(get_run(conn, i)["status"], get_run(conn, i)["attempts"]) for i in ids]
    assert got == [("succeeded", 1), ("queued", 0), ("failed", 1)]
    snoozed = get_run(conn, ids[1])
    assert snoozed["snoozes"] == 1 and snoozed["history"][-1]["outcome"] == "snoozed"
    assert get_run(conn, ids[2])["error"] == "Fail: bad record"


# -- leasework.testing -------------------------------------------------------------------------------


def test_run_task_reports_a_snooze_and_a_fail(conn: Conn) -> None:
    app = App()

    @app.task("nap", max_attempts=1)
    def nap(ctx: Context, payload: Any) -> None:
        raise Snooze(after=3600)

    @app.task("give_up", max_attempts=4)
    def give_up(ctx: Context, payload: Any) -> None:
        raise Fail("record 42 was deleted")

    napped = run_task(app, conn, "nap")
    assert (napped.status, napped.outcome, napped.attempts, napped.snoozes) == (
        "queued",
        "snoozed",
        0,
        1,
    )
    assert napped.snoozed and napped.due_at is not None and napped.error is None
    failed = run_task(app, conn, "give_up")
    assert (failed.status, failed.outcome, failed.attempts) == ("failed", "failed", 1)
    assert failed.error == "Fail: record 42 was deleted" and not failed.snoozed


def test_drain_jumps_a_snooze(conn: Conn) -> None:
    app = App()

    @app.task("job", max_attempts=1)
    def job(ctx: Context, payload: Any) -> str:
        if ctx.attempt == 1 and not ctx.result:
            ctx.result = "woke"
            raise Snooze(after=3600)
        return "done"

    app.enqueue(conn, "job")
    assert drain(app, conn).statuses == ["queued"]
    ran = drain(app, conn, jump_delays=True)
    assert ran.statuses == ["succeeded"] and ran[0].outcome == "succeeded"
    assert ran[0].snoozes == 1


def test_an_async_task_snoozes_under_run_task(conn: Conn) -> None:
    app = App()

    @app.task("io")
    async def io(ctx: AsyncContext, payload: Any) -> None:
        raise Snooze(after=5)

    with Runner(app, conn) as runner:
        result = runner.run_task("io")
    assert result.snoozed and result.attempts == 0


# -- the readers -------------------------------------------------------------------------------------


def test_show_and_the_run_page_show_snoozes(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()

    @app.task("job")
    def job(ctx: Context, payload: Any) -> None:
        raise Snooze(after=60, reason="window closed")

    run_id = app.enqueue(conn, "job")
    worker = make_worker(app)
    worker.poll()
    make_due(conn, run_id)
    # The next attempt, claimed as a worker would and still running: attempt 1 again.
    [claim] = lease.claim_runs(conn, ["job"], worker="w-now", lease=30.0)
    assert claim.attempts == 1
    run = get_run(conn, run_id)
    now = lease.db_now(conn)
    text = render_run(run, now)
    assert "snoozes:   1 (not charged as attempts)" in text
    [line] = [x for x in text.splitlines() if " snoozed " in x]
    due = run["history"][0]["due_at"][:19]
    assert line.startswith("  #1 snoozed") and f"until {due}" in line
    assert line.endswith("window closed")
    page = pages.run_page(run, now=now)
    history = page.split('id="history"')[1].split("</section>")[0]
    assert 's-snoozed">snoozed' in history and "window closed" in history
    assert "until " in history
    # The attempt in progress has the number of the snoozed entry (the snooze gave it back),
    # and is shown all the same.
    assert history.count("<tr>") == 3 and 's-running">running' in history
    assert "snoozes" in page.split('id="run"')[1].split("</section>")[0]


ODD_SNOOZES = [
    '[{"outcome": "snoozed", "due_at": {"a": 1}, "error": 5, "owner": 7}]',
    '[{"outcome": "snoozed", "due_at": "\\u001b[2J 2030-01-01", "error": "\\u001b]8;;x"}]',
    '[{"outcome": "snoozed", "due_at": 1e400, "owner": null}, {"owner": ["x"]}, "x", 7]',
    '{"outcome": "snoozed", "due_at": "soon"}',
]


@pytest.mark.parametrize("history", ODD_SNOOZES)
def test_the_readers_survive_snoozed_entries_of_any_shape(conn: Conn, history: str) -> None:
    """The history is jsonb the worker role can write: a snoozed entry of any shape is shown,
    its control characters escaped, and neither reader fails."""
    app = App()
    app.task("job")(lambda ctx, payload: None)
    run_id = app.enqueue(conn, "job")
    assert lease.claim_runs(conn, ["job"], worker="w", lease=30.0)
    conn.execute(
        "UPDATE leasework.runs SET history = %s::jsonb, snoozes = 2147483647 WHERE id = %s",
        (history, run_id),
    )
    run = get_run(conn, run_id)
    now = lease.db_now(conn)
    text = render_run(run, now)
    assert "\x1b" not in text and "snoozes:   2147483647" in text
    page = pages.run_page(run, now=now)
    assert "\x1b" not in page and 's-running">running' in page
