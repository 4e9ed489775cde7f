"""leasework.testing on real Postgres: run_task runs one task through the real claim, lease,
Context and outcome (fenced transaction and checkpoints included, Retry/Partial/Aborted as
outcomes); drain runs due runs of the chosen kinds only, never the schedule stage; the
assertions read back what was enqueued."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest

from leasework import Aborted, App, ConfigError, Context, LeaseworkError, Partial, Retry
from leasework.errors import UnknownKind
from leasework.testing import Runner, assert_enqueued, drain, enqueued, run_task

Conn = psycopg.Connection[Any]


def make_app() -> App:
    app = App()

    @app.task("effects")
    def effects(ctx: Context, payload: dict[str, Any]) -> dict[str, int]:
        ctx.set_total(len(payload["items"]))
        for i in range(ctx.processed, len(payload["items"])):
            with ctx.transaction() as conn:
                conn.execute(
                    "INSERT INTO testing_effects (item) VALUES (%s)", (payload["items"][i],)
                )
                ctx.checkpoint(i + 1)
        return {"done": len(payload["items"])}

    @app.task("retry")
    def retry(ctx: Context, payload: dict[str, Any]) -> str:
        if ctx.attempt < payload.get("succeed_on", 99):
            raise Retry(after=600)
        return "ok"

    @app.task("partial")
    def partial(ctx: Context, payload: Any) -> None:
        raise Partial({"half": True})

    @app.task("boom", max_attempts=1)
    def boom(ctx: Context, payload: Any) -> None:
        raise ValueError("no such account")

    @app.task("self_cancel")
    def self_cancel(ctx: Context, payload: Any) -> None:
        with psycopg.connect(payload["dsn"], autocommit=True) as other:
            app.cancel(other, ctx.run_id)
        ctx.result = {"stopped_at": 1}
        for _ in range(1000):
            ctx.check()  # the cancel is seen at the next control check
        raise AssertionError("never aborted")

    @app.task("fanout")
    def fanout(ctx: Context, *, n: int) -> None:
        with ctx.transaction() as conn:
            for i in range(n):
                child.enqueue(conn, i=i)

    @app.task("child")
    def child(ctx: Context, *, i: int) -> int:
        return i * 10

    @app.task("other")
    def other(ctx: Context, payload: Any) -> None:
        return None

    @app.task("ticker", every=60)
    def ticker(ctx: Context, payload: Any) -> None:
        return None

    return app


@pytest.fixture
def app(conn: Conn) -> App:
    conn.execute("DROP TABLE IF EXISTS testing_effects")
    conn.execute("CREATE TABLE testing_effects (item text)")
    return make_app()


def test_run_task_runs_the_handler_with_a_real_context(app: App, conn: Conn) -> None:
    out = run_task(app, conn, "effects", {"items": ["a", "b", "c"]})
    assert (out.status, out.result, out.error, out.attempts) == ("succeeded", {"done": 3}, None, 1)
    assert conn.execute("SELECT item FROM testing_effects ORDER BY item").fetchall() == [
        ("a",),
        ("b",),
        ("c",),
    ]
    row = conn.execute(
        "SELECT processed_units, total_units, lease_owner FROM leasework.runs WHERE id = %s",
        (out.run_id,),
    ).fetchone()
    assert row == (3, 3, None)


def test_a_handlers_log_records_carry_their_run_under_caplog(
    app: App, conn: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    """What a user's test asserts on: the run fields are attributes of the records pytest's log
    capture keeps, not only in leasework's own formatted lines; a handler's own `extra` of the
    same name is neither refused (a KeyError in its log call) nor overwritten."""
    logged = logging.getLogger("myapp.reports")

    @app.task("logs")
    def logs(ctx: Context, payload: Any) -> None:
        logged.warning("sending week %s", payload["week"])
        logged.warning("mine", extra={"kind": "invoice"})

    caplog.set_level(logging.INFO, logger="myapp")
    out = run_task(app, conn, "logs", {"week": 48})
    assert out.status == "succeeded", out.error
    sent, mine = [r for r in caplog.records if r.name == "myapp.reports"]
    assert (sent.run_id, sent.kind, sent.attempt) == (out.run_id, "logs", 1)  # type: ignore[attr-defined]
    assert sent.leasework_run == {"run_id": out.run_id, "kind": "logs", "attempt": 1}  # type: ignore[attr-defined]
    assert (mine.run_id, mine.kind) == (out.run_id, "invoice")  # type: ignore[attr-defined]
    logged.warning("after the run")
    assert not hasattr(caplog.records[-1], "run_id")


def test_retry_partial_failure_and_abort_come_back_as_outcomes(
    app: App, conn: Conn, dsn: str
) -> None:
    retried = run_task(app, conn, "retry", {})
    assert retried.status == "queued" and retried.due_at is not None
    assert retried.error and "retry" in retried.error.lower()
    partial = run_task(app, conn, "partial")
    assert (partial.status, partial.result) == ("partial", {"half": True})
    failed = run_task(app, conn, "boom")
    assert failed.status == "failed" and "no such account" in (failed.error or "")
    cancelled = run_task(app, conn, "self_cancel", {"dsn": dsn})
    assert cancelled.status == "cancelled"
    assert cancelled.result == {"stopped_at": 1}
    assert issubclass(Aborted, LeaseworkError)  # what ctx.check() raised inside, not here


def test_drain_runs_only_the_chosen_kinds_and_never_the_schedule(app: App, conn: Conn) -> None:
    app.enqueue(conn, "fanout", {"n": 3})
    app.enqueue(conn, "other")
    ran = drain(app, conn, kinds=["fanout"])
    assert ran.statuses == ["succeeded"]
    assert [r["payload"] for r in enqueued(conn, "child")] == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert enqueued(conn, "other", status="queued")  # not its kind: left alone
    ran = drain(app, conn, ["child"])
    assert [r.result for r in ran] == [0, 10, 20]
    # the periodic task was never enqueued: drain runs no schedule stage
    assert enqueued(conn, "ticker") == []
    assert conn.execute("SELECT count(*) FROM leasework.schedules").fetchone() == (0,)


def test_drain_jumps_delays_only_when_asked(app: App, conn: Conn) -> None:
    run_id = app.enqueue(conn, "retry", {"succeed_on": 3})
    later = app.enqueue(conn, "other", delay=86400)
    ran = drain(app, conn)
    assert [(r.run_id, r.status) for r in ran] == [(run_id, "queued")]  # its backoff is 600 s
    ran = drain(app, conn, jump_delays=True)
    # due times kept their order: the retries (600 s each) went before the day-long delay
    assert [(r.run_id, r.status, r.attempts) for r in ran] == [
        (run_id, "queued", 2),
        (run_id, "succeeded", 3),
        (later, "succeeded", 1),
    ]


def test_drain_stops_at_max_runs(app: App, conn: Conn) -> None:
    for _ in range(3):
        app.enqueue(conn, "other")
    with pytest.raises(LeaseworkError, match="drain ran 2 attempts and runs are still due"):
        drain(app, conn, max_runs=2)
    assert len(enqueued(conn, "other", status="queued")) == 1  # the third released, not run


def test_run_task_and_drain_refuse_an_unknown_kind_in_one_line(app: App, conn: Conn) -> None:
    with pytest.raises(UnknownKind) as info:
        run_task(app, conn, "efects", {})
    assert "'efects'" in str(info.value) and "effects" in str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(UnknownKind):
        drain(app, conn, kinds=["nope"])
    with pytest.raises(ConfigError, match="max_runs must be a positive integer"):
        drain(app, conn, max_runs=0)
    assert enqueued(conn) == []  # nothing written


def test_assert_enqueued_says_what_was_there(app: App, conn: Conn) -> None:
    with conn.transaction():
        app.enqueue(conn, "other", {"a": 1}, key="k1")
        assert_enqueued(conn, "other", {"a": 1})  # uncommitted, in this connection's view
    assert_enqueued(conn, "other", count=1, key="k1")
    with pytest.raises(
        AssertionError,
        match=r"expected at least one run of 'other' with payload \{'a': 2\}, found 0; enqueued: #\d+ other \{'a': 1\} \(queued\)",
    ):
        assert_enqueued(conn, "other", {"a": 2})
    with pytest.raises(AssertionError, match="expected 2 run"):
        assert_enqueued(conn, "other", count=2)
    # a misspelt status is refused, not an empty answer
    with pytest.raises(ConfigError, match=r"status 'queud' is not a run status: use one of blocked, waiting, queued"):
        enqueued(conn, "other", status="queud")


def test_a_runner_serves_several_calls(app: App, conn: Conn) -> None:
    with Runner(app, conn) as runner:
        first = runner.run_task("other")
        second = runner.run_task("child", {"i": 4})
    assert (first.status, second.result) == ("succeeded", 40)
