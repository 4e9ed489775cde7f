"""The workflow builder and batches (docs/workflows.md): a graph enqueued in one transaction,
named; a batch's callback fires exactly once, after every member (those that joined late too),
with the counts of their ends; a closed batch refuses new members."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from leasework import App, ConfigError, Context, Fail
from leasework.leases import lease
from leasework.stages import deps
from leasework.testing import drain

Conn = psycopg.Connection[Any]


def status(conn: Conn, run_id: int) -> str:
    row = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return str(row[0])


@pytest.fixture
def seen() -> list[Any]:
    return []


@pytest.fixture
def app(seen: list[Any]) -> App:
    app = App()

    @app.task("work")
    def work(ctx: Context, payload: Any) -> Any:
        if payload.get("fail"):
            raise Fail("asked to fail")
        return {"n": payload.get("n")}

    @app.task("callback")
    def callback(ctx: Context, payload: Any) -> None:
        parents = ctx.parents()
        seen.append((payload, parents.counts, sorted(p.id for p in parents.members)))

    return app


def test_the_builder_enqueues_a_graph_in_one_transaction(app: App, conn: Conn) -> None:
    wf = app.workflow()
    a = wf.add("work", {"n": 1}, name="a")
    chain = wf.chain(("work", {"n": 2}), ("work", {"n": 3}), after=a)
    fan = wf.group([("work", {"n": i}) for i in range(3)], name="fan", after=a)
    wf.add("callback", {"join": True}, after=[fan, chain], name="join")
    wf.add("work", {"n": 9})
    ids = wf.enqueue(conn)
    assert list(ids) == ["a", "work#1", "work#2", "fan[0]", "fan[1]", "fan[2]", "join", "work#7"]
    parents = conn.execute(
        "SELECT parent FROM leasework.run_deps WHERE child = %s ORDER BY parent", (ids["join"],)
    ).fetchall()
    expected = [ids["work#1"], ids["work#2"], *(ids[f"fan[{i}]"] for i in range(3))]
    assert [p[0] for p in parents] == sorted(expected)
    drain(app, conn)
    assert {status(conn, i) for i in ids.values()} == {"succeeded"}


def test_a_builder_that_fails_half_way_writes_nothing(app: App, conn: Conn) -> None:
    wf = app.workflow()
    a = wf.add("work", {"n": 1})
    wf.add("work", {"n": 2}, after=[a, 424242])  # no such run
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        wf.enqueue(conn)
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (0,)


def test_the_builder_refuses_what_is_not_a_graph(app: App) -> None:
    wf, other = app.workflow(), app.workflow()
    a = wf.add("work", {}, name="a")
    with pytest.raises(ConfigError, match="two nodes are named 'a'"):
        wf.add("work", {}, name="a")
    with pytest.raises(ConfigError, match="is not a node of this workflow"):
        wf.add("work", {}, after=other.add("work", {}, name="x"))
    with pytest.raises(ConfigError, match="after takes nodes or groups"):
        wf.add("work", {}, after=["a"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="group items must be"):
        wf.group(["work"])  # type: ignore[list-item]
    assert a.name == "a"


def test_the_builder_enqueues_on_an_async_connection(app: App, dsn: str, conn: Conn) -> None:
    async def go() -> dict[str, int]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            wf = app.workflow()
            a = wf.add("work", {"n": 1}, name="a")
            wf.add("work", {"n": 2}, name="b", after=a)
            return await wf.enqueue_async(aconn)

    ids = asyncio.run(go())
    assert [status(conn, ids["a"]), status(conn, ids["b"])] == ["queued", "blocked"]


def test_a_batch_fires_once_with_its_counts(app: App, conn: Conn, seen: list[Any]) -> None:
    batch = app.batch("callback", {"b": 1})
    ok = [batch.add(conn, "work", {"n": i}) for i in range(3)]
    bad = batch.add(conn, "work", {"fail": True})
    callback = batch.close(conn)
    assert status(conn, callback) == "blocked"
    drain(app, conn)
    assert seen == [
        ({"b": 1}, {"succeeded": 3, "partial": 0, "failed": 1, "cancelled": 0}, sorted([*ok, bad]))
    ]
    assert status(conn, callback) == "succeeded"


def test_an_empty_batch_fires_at_once(app: App, conn: Conn, seen: list[Any]) -> None:
    callback = app.batch("callback", {"empty": True}).close(conn)
    assert status(conn, callback) == "queued"
    drain(app, conn)
    assert seen == [({"empty": True}, {"succeeded": 0, "partial": 0, "failed": 0, "cancelled": 0}, [])]


def test_a_batch_opened_in_a_handler_waits_for_it_and_for_late_members(
    app: App, conn: Conn, dsn: str, seen: list[Any]
) -> None:
    """Members added by the opener, and by a member while it runs, all count; the callback
    cannot fire in between (the opener and that member hold it open)."""

    @app.task("opener")
    def opener(ctx: Context, payload: Any) -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            batch = app.batch("callback", {"opened": True}).open(c, opened_by=ctx.run_id)
            for n in range(2):
                batch.add(c, "spawner", {"n": n, "batch": batch.id})

    @app.task("spawner")
    def spawner(ctx: Context, payload: Any) -> int:
        if payload["n"] == 0:
            with psycopg.connect(dsn, autocommit=True) as c:
                app.batch_of(payload["batch"]).add(c, "work", {"n": 100})
        return int(payload["n"])

    app.enqueue(conn, "opener", {})
    drain(app, conn)
    assert len(seen) == 1
    _, counts, members = seen[0]
    assert counts["succeeded"] == 3 and len(members) == 3
    callback = conn.execute("SELECT id FROM leasework.runs WHERE kind = 'callback'").fetchone()
    assert callback is not None
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=f"batch {callback[0]} is closed"):
        app.batch_of(callback[0]).add(conn, "work", {"n": 1})


def test_members_ending_together_fire_the_callback_once(
    app: App, conn: Conn, dsn: str, seen: list[Any]
) -> None:
    batch = app.batch("callback", {})
    batch.add(conn, "work", {"n": 1})
    batch.add(conn, "work", {"n": 2})
    callback = batch.close(conn)
    first, second = (lease.claim_runs(conn, ["work"], worker="w", lease=30.0)[0] for _ in range(2))
    with psycopg.connect(dsn) as a, psycopg.connect(dsn) as b:
        assert lease.finish(a, first, "succeeded")
        assert lease.finish(b, second, "succeeded")
        a.commit()
        deps.settle(conn, 100)  # sees the first end only
        assert status(conn, callback) == "blocked"
        b.commit()
    deps.settle(conn, 100)
    deps.settle(conn, 100)
    assert status(conn, callback) == "queued"
    drain(app, conn)
    assert len(seen) == 1


def test_a_join_waits_for_a_batch_callback_holding_its_row(app: App, conn: Conn, dsn: str) -> None:
    """A join locks the callback's row: a deps step meanwhile leaves the callback (SKIP LOCKED)
    and decides it after the join commits, counting the new member."""
    batch = app.batch("callback", {})
    first = batch.add(conn, "work", {"n": 1})
    callback = batch.close(conn)
    held = lease.claim_runs(conn, ["work"], worker="w", lease=30.0)[0]
    with psycopg.connect(dsn) as joining:
        late = app.batch_of(callback).add(joining, "work", {"n": 2})  # open transaction
        assert lease.finish(conn, held, "succeeded")
        deps.settle(conn, 100)
        assert status(conn, callback) == "blocked"
        joining.commit()
    deps.settle(conn, 100)
    assert status(conn, callback) == "blocked"  # waits for the late member
    assert [status(conn, first), status(conn, late)] == ["succeeded", "queued"]
    drain(app, conn)
    assert status(conn, callback) == "succeeded"


def test_batch_refusals(app: App, conn: Conn) -> None:
    batch = app.batch("callback", {})
    with pytest.raises(ConfigError, match="a batch member cannot wait"):
        batch.add(conn, "work", {}, after=[1])
    with pytest.raises(ConfigError, match="a batch's callback takes no key"):
        app.batch("callback", {}, key="k")
    with pytest.raises(ConfigError, match="batch id must be a positive integer"):
        app.batch_of(0)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="there is no batch 4242"):
        app.batch_of(4242).add(conn, "work", {})
    a = app.enqueue(conn, "work", {})
    b = app.enqueue(conn, "work", {}, after=[a])
    callback = app.batch("callback", {}).open(conn, opened_by=a).id
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="only a run without after"):
        conn.execute("SELECT leasework.join_batch(%s, %s)", (callback, b))
