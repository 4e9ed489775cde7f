"""Durable steps (`ctx.step(name, fn, *args)`, leasework.run_steps): a step's value is stored once
per run under the lease's fence and a later attempt gets it instead of calling fn again; inside
`ctx.transaction()` the record commits or rolls back with the effects; a lost lease stores
nothing; a name is used once per attempt; the steps go with their run, and an operator's retry
keeps them unless asked. Chaos (kill -9, SIGSTOP during a step): tests/chaos/test_steps_chaos.py
and tests/process/test_steps_kill.py."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from leasework import Aborted, App, Context, LeaseLost
from leasework.leases import lease
from leasework.testing import drain
from leasework.workers.acontext import AsyncContext
from leasework.workers.worker import Worker

from ..conftest import expire_lease, get_run

Conn = psycopg.Connection[Any]
MakeWorker = Callable[..., Worker]


def stored(conn: Conn, run_id: int) -> dict[str, Any]:
    rows = conn.execute(
        "SELECT name, value, attempt FROM leasework.run_steps WHERE run_id = %s", (run_id,)
    ).fetchall()
    return {r[0]: (r[1], r[2]) for r in rows}


@pytest.fixture
def effects(conn: Conn) -> Conn:
    conn.execute("CREATE TABLE IF NOT EXISTS public.step_effects (run_id bigint, name text)")
    conn.execute("TRUNCATE public.step_effects")
    return conn


def test_a_retried_attempt_gets_the_stored_values_instead_of_calling_again(
    dsn: str, conn: Conn
) -> None:
    app = App()
    calls: Counter[str] = Counter()

    def charge(card: str, amount: int) -> dict[str, Any]:
        calls["charge"] += 1
        return {"charged": amount, "card": card, "call": calls["charge"]}

    def nothing() -> None:
        calls["nothing"] += 1

    @app.task("order", max_attempts=3)
    def order(ctx: Context, payload: Any) -> Any:
        receipt = ctx.step("charge", charge, "4242", amount=10)
        empty = ctx.step("nothing", nothing)
        pair = ctx.step("pair", lambda: (1, 2))
        if ctx.attempt < 3:
            raise RuntimeError(f"the mailer is down (attempt {ctx.attempt})")
        return {"receipt": receipt, "empty": empty, "pair": pair}

    run_id = app.enqueue(conn, "order")
    drain(app, dsn, ["order"], jump_delays=True)
    row = get_run(conn, run_id)
    assert row["status"] == "succeeded" and row["attempts"] == 3, row["history"]
    assert calls == {"charge": 1, "nothing": 1}, "each step's fn ran once in three attempts"
    # A stored value reads back as JSON gives it, in every attempt alike (a tuple is a list).
    assert row["result"] == {
        "receipt": {"charged": 10, "card": "4242", "call": 1},
        "empty": None,
        "pair": [1, 2],
    }
    assert stored(conn, run_id) == {
        "charge": ({"charged": 10, "card": "4242", "call": 1}, 1),
        "nothing": (None, 1),
        "pair": ([1, 2], 1),
    }


def test_a_step_that_raises_stores_nothing_and_runs_again(dsn: str, conn: Conn) -> None:
    app = App()
    calls: list[int] = []

    def flaky(attempt: int) -> int:
        calls.append(attempt)
        if attempt == 1:
            raise ConnectionError("provider timed out")
        return attempt

    @app.task("job", max_attempts=2)
    def job(ctx: Context, payload: Any) -> Any:
        return ctx.step("fetch", flaky, ctx.attempt)

    run_id = app.enqueue(conn, "job")
    drain(app, dsn, ["job"], jump_delays=True)
    assert calls == [1, 2]
    assert get_run(conn, run_id)["result"] == 2
    assert stored(conn, run_id) == {"fetch": (2, 2)}


def test_a_name_used_twice_in_one_attempt_is_refused(dsn: str, conn: Conn) -> None:
    app = App()

    @app.task("job", max_attempts=1)
    def job(ctx: Context, payload: Any) -> Any:
        ctx.step("page", lambda: 1)
        return ctx.step("page", lambda: 2)

    run_id = app.enqueue(conn, "job")
    drain(app, dsn, ["job"])
    row = get_run(conn, run_id)
    assert row["status"] == "failed"
    assert "ctx.step('page') was already called in this attempt" in row["error"]
    assert stored(conn, run_id) == {"page": (1, 1)}


def test_bad_names_and_values_fail_the_attempt_and_store_nothing(dsn: str, conn: Conn) -> None:
    app = App()

    @app.task("noname", max_attempts=1)
    def noname(ctx: Context, payload: Any) -> Any:
        return ctx.step("", lambda: 1)

    @app.task("notjson", max_attempts=1)
    def notjson(ctx: Context, payload: Any) -> Any:
        return ctx.step("when", lambda: object())

    a = app.enqueue(conn, "noname")
    b = app.enqueue(conn, "notjson")
    drain(app, dsn, ["noname", "notjson"])
    assert "name must be a string of 1 to 200 characters" in get_run(conn, a)["error"]
    assert "the value of step 'when' is not JSON-serializable" in get_run(conn, b)["error"]
    assert stored(conn, a) == {} and stored(conn, b) == {}


def test_inside_a_transaction_the_step_commits_and_rolls_back_with_the_effects(
    dsn: str, effects: Conn
) -> None:
    app = App()
    calls: list[str] = []

    def record(name: str) -> str:
        calls.append(name)
        return name.upper()

    @app.task("job", max_attempts=1)
    def job(ctx: Context, payload: Any) -> Any:
        with ctx.transaction() as tx:
            tx.execute("INSERT INTO public.step_effects VALUES (%s, 'kept')", (ctx.run_id,))
            kept = ctx.step("kept", record, "kept")
        with pytest.raises(ZeroDivisionError), ctx.transaction() as tx:
            tx.execute("INSERT INTO public.step_effects VALUES (%s, 'undone')", (ctx.run_id,))
            ctx.step("undone", record, "undone")
            1 / 0  # noqa: B018
        # Rolled back: never stored, so the name may be used again, and fn runs again.
        again = ctx.step("undone", record, "undone")
        return [kept, again]

    run_id = app.enqueue(effects, "job")
    drain(app, dsn, ["job"])
    assert get_run(effects, run_id)["result"] == ["KEPT", "UNDONE"]
    assert calls == ["kept", "undone", "undone"]
    assert stored(effects, run_id) == {"kept": ("KEPT", 1), "undone": ("UNDONE", 1)}
    rows = effects.execute("SELECT name FROM public.step_effects").fetchall()
    assert rows == [("kept",)]


def test_a_step_after_the_lease_was_lost_stores_nothing(
    dsn: str, conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    seen: list[str] = []

    def thief_takes_it(run_id: int) -> str:
        with psycopg.connect(dsn, autocommit=True) as c:
            expire_lease(c, run_id)
            assert [cl.id for cl in lease.claim_runs(c, ["job"], worker="thief", lease=30.0)]
        return "too late"

    @app.task("job")
    def job(ctx: Context, payload: Any) -> Any:
        ctx.step("first", lambda: 1)
        try:
            ctx.step("second", thief_takes_it, ctx.run_id)
        except Aborted as exc:
            seen.append(f"Aborted({exc.reason})")
            raise
        return "never"

    a = app.enqueue(conn, "job")
    make_worker(app).poll()
    assert seen == ["Aborted(lost)"]
    assert stored(conn, a) == {"first": (1, 1)}
    assert get_run(conn, a)["lease_worker"] == "thief"

    @app.task("tx2", max_attempts=1)
    def tx2(ctx: Context, payload: Any) -> Any:
        with ctx.transaction():
            # Inside the fenced transaction nobody can take the run, but its lease can run out
            # (a handler that stalled): the step then stores nothing.
            with psycopg.connect(dsn, autocommit=True) as c:
                expire_lease(c, ctx.run_id)
            try:
                ctx.step("inside", lambda: 1)
            except LeaseLost:
                seen.append("LeaseLost")
                raise

    b = app.enqueue(conn, "tx2")
    make_worker(app).poll()
    assert seen == ["Aborted(lost)", "LeaseLost"]
    assert stored(conn, b) == {}


def test_steps_are_read_once_per_attempt(dsn: str, conn: Conn) -> None:
    """One query at the first step of an attempt, none at the claim or at later steps."""
    app = App()
    queries: list[int] = []

    real = lease.load_steps

    def counting(c: Any, claim: Any) -> dict[str, str]:
        queries.append(claim.attempts)
        return real(c, claim)

    @app.task("job", max_attempts=2)
    def job(ctx: Context, payload: Any) -> Any:
        values = [ctx.step(f"page-{n}", lambda n=n: n) for n in range(5)]
        if ctx.attempt == 1:
            raise RuntimeError("again")
        return values

    @app.task("plain")
    def plain(ctx: Context, payload: Any) -> Any:
        return "no steps"

    mp = pytest.MonkeyPatch()
    mp.setattr(lease, "load_steps", counting)
    try:
        run_id = app.enqueue(conn, "job")
        app.enqueue(conn, "plain")
        drain(app, dsn, ["job", "plain"], jump_delays=True)
    finally:
        mp.undo()
    assert queries == [1, 2]
    assert get_run(conn, run_id)["result"] == [0, 1, 2, 3, 4]


def test_async_handlers_step_with_sync_and_async_functions(dsn: str, conn: Conn) -> None:
    app = App()
    calls: Counter[str] = Counter()

    async def fetch(url: str) -> str:
        calls["fetch"] += 1
        return f"body of {url}"

    def parse(body: str) -> int:
        calls["parse"] += 1
        return len(body)

    @app.task("crawl", max_attempts=2)
    async def crawl(ctx: AsyncContext, payload: Any) -> Any:
        body = await ctx.step("fetch", fetch, "https://example.org")
        size = await ctx.step("parse", parse, body)
        async with ctx.transaction() as tx:
            await tx.execute("SELECT 1")
            inside = await ctx.step("inside", fetch, "inside")
        if ctx.attempt == 1:
            raise RuntimeError("again")
        return [body, size, inside]

    run_id = app.enqueue(conn, "crawl")
    drain(app, dsn, ["crawl"], jump_delays=True)
    row = get_run(conn, run_id)
    assert row["status"] == "succeeded", row["error"]
    assert row["result"] == ["body of https://example.org", 27, "body of inside"]
    assert calls == {"fetch": 2, "parse": 1}
    assert set(stored(conn, run_id)) == {"fetch", "parse", "inside"}


def test_the_steps_go_with_their_run_and_a_retry_keeps_them_unless_asked(
    dsn: str, conn: Conn
) -> None:
    app = App()
    calls: list[int] = []

    @app.task("job", max_attempts=1)
    def job(ctx: Context, payload: Any) -> Any:
        got = ctx.step("one", lambda: calls.append(1) or len(calls))
        if payload.get("fail"):
            raise RuntimeError("bug")
        return got

    kept = app.enqueue(conn, "job", {"fail": True})
    cleared = app.enqueue(conn, "job", {"fail": True})
    drain(app, dsn, ["job"])
    assert calls == [1, 1]
    conn.execute(
        "UPDATE leasework.runs SET payload = '{}' WHERE id = ANY(%s)", ([kept, cleared],)
    )
    app.retry(conn, [kept])
    app.retry(conn, [cleared], clear_steps=True)
    drain(app, dsn, ["job"])
    assert get_run(conn, kept)["result"] == 1, "the stored step, not a new call"
    assert get_run(conn, cleared)["result"] == 3, "the steps cleared: called again"
    app.delete(conn, [kept])
    assert stored(conn, kept) == {}
    assert stored(conn, cleared) == {"one": (3, 2)}


def test_show_lists_the_steps_and_retry_clear_steps_deletes_them(
    dsn: str, conn: Conn, tmp_path: Any
) -> None:
    from .test_cli import make_cli

    app = App()

    @app.task("job", max_attempts=1)
    def job(ctx: Context, payload: Any) -> Any:
        ctx.step("fetch\x1b[2J", lambda: {"rows": list(range(10))})
        ctx.step("parse", lambda: None)
        raise RuntimeError("bug in the last step")

    run_id = app.enqueue(conn, "job")
    other = app.enqueue(conn, "job")
    drain(app, dsn, ["job"])
    cli = make_cli(tmp_path, dsn)
    shown = cli("show", str(run_id))
    assert shown.returncode == 0, shown.stderr
    assert "steps (2 stored, ctx.step):" in shown.stdout
    assert "fetch\\x1b[2J  40 B  attempt 1" in shown.stdout, shown.stdout
    assert "parse  4 B  attempt 1" in shown.stdout
    as_json = cli("show", str(run_id), "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert '"name":"parse"' in as_json.stdout.replace(" ", "")
    retried = cli("retry", str(run_id), "--clear-steps")
    assert retried.returncode == 0, retried.stderr
    assert stored(conn, run_id) == {}
    assert get_run(conn, run_id)["status"] == "queued"
    assert set(stored(conn, other)) == {"fetch\x1b[2J", "parse"}, "only the runs retried"
