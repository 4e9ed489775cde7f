"""A policy per dependency (docs/workflows.md, "A policy per dependency"): `After(run,
on_failure=...)` in `after`, and leasework.set_dependency_policy in SQL, give one parent a policy
of its own; the others keep the run's `on_parent_failure`. Set in the enqueue's own transaction
(a committed run's policy is refused), decided by the deps stage from the edges as set, and, for a
run whose parents had all ended at its enqueue, decided again at once."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from leasework import After, App, ConfigError, Context
from leasework.stages import deps
from leasework.testing import drain

from .test_dependencies import status, statuses
from .test_roles import roles  # noqa: F401  (the fixture)

Conn = psycopg.Connection[Any]


def make_app() -> App:
    app = App()

    @app.task("step")
    def step(ctx: Context, payload: Any) -> Any:
        if payload.get("fail"):
            raise RuntimeError(f"{payload.get('name')} fails")
        return {"parents": sorted((p.id, p.status) for p in ctx.parents())}

    return app


@pytest.fixture
def app() -> App:
    return make_app()


def edges(conn: Conn, child: int) -> dict[int, bool]:
    rows = conn.execute(
        "SELECT parent, anyway FROM leasework.run_deps WHERE child = %s", (child,)
    ).fetchall()
    return {int(p): bool(a) for p, a in rows}


def error(conn: Conn, run_id: int) -> str | None:
    row = conn.execute("SELECT error FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return row[0]


def test_one_parent_with_its_own_policy_beside_the_runs(app: App, conn: Conn) -> None:
    """A run after a failing parent under "run" and a good parent under the run's "cancel" runs;
    one whose "cancel" parent fails is cancelled, whatever its "run" parent did."""
    with conn.transaction():
        good = app.enqueue(conn, "step", {"name": "good"})
        bad = app.enqueue(conn, "step", {"name": "bad", "fail": True}, max_attempts=1)
        runs = app.enqueue(conn, "step", {}, after=[good, After(bad, on_failure="run")])
        stops = app.enqueue(conn, "step", {}, after=[bad, After(good, "run")])
        # the run's own policy "run", one parent under "cancel"
        flipped = app.enqueue(
            conn, "step", {}, after=[good, After(bad, "cancel")], on_parent_failure="run"
        )
    assert edges(conn, runs) == {good: False, bad: True}
    assert edges(conn, stops) == {bad: False, good: True}
    assert edges(conn, flipped) == {good: True, bad: False}
    assert statuses(conn, runs, stops, flipped) == ["blocked"] * 3
    drain(app, conn)
    assert statuses(conn, good, bad, runs, stops, flipped) == [
        "succeeded", "failed", "succeeded", "cancelled", "cancelled",
    ]
    assert error(conn, stops) == f"run {bad}, which it waited for, ended failed"
    assert error(conn, flipped) == f"run {bad}, which it waited for, ended failed"
    row = conn.execute("SELECT result FROM leasework.runs WHERE id = %s", (runs,)).fetchone()
    assert row is not None and row[0] == {"parents": [[good, "succeeded"], [bad, "failed"]]}


def test_a_cancel_goes_down_the_edges_under_cancel_only(app: App, conn: Conn) -> None:
    """Cancelling a run cancels what waits on it under "cancel" (and on down the graph), and
    queues what waits on it under "run", edge by edge."""
    with conn.transaction():
        top = app.enqueue(conn, "step", {}, delay=3600)
        other = app.enqueue(conn, "step", {})
        stays = app.enqueue(conn, "step", {}, after=[After(top, "run"), other])
        goes = app.enqueue(conn, "step", {}, after=[top, After(other, "run")])
        below = app.enqueue(conn, "step", {}, after=[goes])
    assert app.cancel(conn, top) == "cancelled"
    drain(app, conn)
    assert statuses(conn, other, stays, goes, below) == [
        "succeeded", "succeeded", "cancelled", "cancelled",
    ]
    assert error(conn, goes) == f"run {top}, which it waited for, ended cancelled"


def test_parents_that_ended_before_the_enqueue_decide_by_the_edges_as_set(
    app: App, conn: Conn
) -> None:
    """Every parent ended already: the enqueue decides the run at once by the run's policy, and
    the edge's own policy decides it again in the same statement, either way."""
    ok = app.enqueue(conn, "step", {})
    failed = app.enqueue(conn, "step", {"fail": True}, max_attempts=1)
    drain(app, conn)
    assert statuses(conn, ok, failed) == ["succeeded", "failed"]
    revived = app.enqueue(conn, "step", {}, after=[ok, After(failed, "run")], tenant="acme")
    assert status(conn, revived) == "queued"
    assert error(conn, revived) is None
    dropped = app.enqueue(
        conn, "step", {}, after=[ok, After(failed, "cancel")], on_parent_failure="run"
    )
    assert status(conn, dropped) == "cancelled"
    assert error(conn, dropped) == f"run {failed}, which it waited for, ended failed"
    row = conn.execute(
        "SELECT finished_at IS NOT NULL FROM leasework.runs WHERE id = %s", (dropped,)
    ).fetchone()
    assert row == (True,)
    ran = drain(app, conn)
    assert [r.run_id for r in ran] == [revived]
    assert statuses(conn, revived, dropped) == ["succeeded", "cancelled"]


def test_enqueue_many_the_typed_enqueue_and_async_take_an_own_policy(
    app: App, dsn: str, conn: Conn
) -> None:
    @app.task("typed")
    def typed(ctx: Context, *, n: int) -> int:
        return n

    bad = app.enqueue(conn, "step", {"fail": True}, max_attempts=1, delay=3600)
    many = app.enqueue_many(conn, "step", [{}, {}], after=[After(bad, "run")])
    one = typed.configure(after=[After(bad, "run")]).enqueue(conn, n=1)

    async def main() -> tuple[int, list[int]]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            a = await app.enqueue_async(aconn, "step", {}, after=[After(bad, "run")])
            b = await app.enqueue_many_async(aconn, "step", [{}], after=[After(bad, "run")])
            return a, b

    a, b = asyncio.run(main())
    for child in [*many, one, a, *b]:
        assert edges(conn, child) == {bad: True}
    conn.execute("UPDATE leasework.runs SET queued_at = leasework.now() WHERE id = %s", (bad,))
    drain(app, conn)
    assert statuses(conn, *many, one, a, *b) == ["succeeded"] * 5


def test_the_workflow_builder_takes_an_own_policy_per_node_or_group(
    app: App, conn: Conn
) -> None:
    wf = app.workflow()
    fetch = wf.add("step", {"fail": True}, name="fetch", max_attempts=1)
    mirror = wf.add("step", {}, name="mirror")
    pages = wf.group([("step", {}), ("step", {})], name="pages", after=After(fetch, "run"))
    wf.add("step", {}, name="summary", after=[After(pages, "run"), mirror])
    wf.add("step", {}, name="strict", after=[fetch, After(mirror, "run")])
    wf.chain(("step", {}), ("step", {}), after=[After(fetch, "run")])
    with pytest.raises(ConfigError, match="After"):
        wf.add("step", {}, after=[After("fetch", "run")])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="on_failure"):
        wf.add("step", {}, after=[After(fetch, "maybe")])  # type: ignore[arg-type]
    ids = wf.enqueue(conn)
    assert edges(conn, ids["pages[0]"]) == {ids["fetch"]: True}
    assert edges(conn, ids["summary"]) == {
        ids["pages[0]"]: True, ids["pages[1]"]: True, ids["mirror"]: False,
    }
    drain(app, conn)
    done = {name: status(conn, i) for name, i in ids.items()}
    assert done["fetch"] == "failed"
    assert done["strict"] == "cancelled"
    assert {n: s for n, s in done.items() if n not in ("fetch", "strict")} == {
        n: "succeeded" for n in done if n not in ("fetch", "strict")
    }


def test_bad_policies_are_refused_in_one_line_before_anything_is_written(
    app: App, conn: Conn
) -> None:
    a = app.enqueue(conn, "step", {})
    cases: list[tuple[dict[str, Any], str]] = [
        ({"after": [After(a, "maybe")]}, r"on_failure=\) must be 'cancel' or 'run', got 'maybe'"),
        ({"after": [a, After(a, "run")]}, f"after gives run {a} two policies, 'cancel' and 'run'"),
        (
            {"after": [After(a, "run")], "on_parent_failure": "batch"},
            "every parent of a batch's callback is a member",
        ),
        ({"after": After(a, "run")}, "after must be a list of run ids, got After"),
        ({"after": [After("x", "run")]}, "after must be a list of run ids"),
    ]
    for options, message in cases:
        with pytest.raises(ConfigError, match=message):
            app.enqueue(conn, "step", {}, **options)
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (1,)
    # the same parent twice with one policy is one edge
    b = app.enqueue(conn, "step", {}, after=[After(a, "run"), After(a, "run")])
    assert edges(conn, b) == {a: True}


def test_sql_sets_a_policy_in_the_enqueuing_transaction_only(conn: Conn) -> None:
    """leasework.set_dependency_policy: in the enqueue's transaction, also inside a savepoint
    (a subtransaction's own id); refused on a committed run, a batch member's edge, an edge that
    does not exist, a bad policy, a run something already waits for."""
    a = conn.execute("SELECT leasework.enqueue('step', delay => 3600)").fetchone()[0]  # type: ignore[index]
    with conn.transaction():
        child = conn.execute(
            "SELECT leasework.enqueue('step', after => ARRAY[%s]::bigint[])", (a,)
        ).fetchone()[0]  # type: ignore[index]
        assert conn.execute(
            "SELECT leasework.set_dependency_policy(%s, %s, 'run')", (child, a)
        ).fetchone() == ("blocked",)
        with conn.transaction():  # a savepoint: written by a subtransaction of this one
            nested = conn.execute(
                "SELECT leasework.enqueue('step', after => ARRAY[%s]::bigint[])", (a,)
            ).fetchone()[0]  # type: ignore[index]
            conn.execute(
                "SELECT leasework.set_dependency_policy(child => %s, parent => %s, policy => 'run')",
                (nested, a),
            )
        assert edges(conn, child) == {a: True}
    assert edges(conn, nested) == {a: True}
    refusals = [
        ((child, a, "cancel"), f"run {child} was enqueued by another transaction"),
        ((a, child, "run"), f"run {a} does not wait for run {child}"),
        ((child, a, "sometimes"), "policy must be 'cancel' or 'run', got 'sometimes'"),
        ((child, a, None), "policy must be 'cancel' or 'run', got NULL"),
    ]
    for args, message in refusals:
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
            conn.execute("SELECT leasework.set_dependency_policy(%s, %s, %s)", args)
    assert edges(conn, child) == {a: True}
    with conn.transaction():
        member = conn.execute("SELECT leasework.enqueue('step')").fetchone()[0]  # type: ignore[index]
        callback = conn.execute(
            "SELECT leasework.enqueue('cb', after => ARRAY[%s]::bigint[],"
            " on_parent_failure => 'batch')",
            (member,),
        ).fetchone()[0]  # type: ignore[index]
        with (
            pytest.raises(psycopg.errors.InvalidParameterValue, match="a member has no policy"),
            conn.transaction(),
        ):
            conn.execute(
                "SELECT leasework.set_dependency_policy(%s, %s, 'cancel')", (callback, member)
            )
        mid = conn.execute(
            "SELECT leasework.enqueue('step', after => ARRAY[%s]::bigint[])", (a,)
        ).fetchone()[0]  # type: ignore[index]
        conn.execute("SELECT leasework.enqueue('step', after => ARRAY[%s]::bigint[])", (mid,))
        with (
            pytest.raises(psycopg.errors.InvalidParameterValue, match="runs already wait for"),
            conn.transaction(),
        ):
            conn.execute("SELECT leasework.set_dependency_policy(%s, %s, 'run')", (mid, a))
    assert edges(conn, mid) == {a: False}


def test_the_deps_stage_never_sees_a_policy_change_it_did_not_decide_by(
    app: App, dsn: str, conn: Conn
) -> None:
    """The policy is set before the commit: a deps step between the enqueue and the commit sees
    neither the run nor its edges, so the parent's end decides the run by the policy as set."""
    bad = app.enqueue(conn, "step", {"fail": True}, max_attempts=1, delay=3600)
    with psycopg.connect(dsn) as other:
        child = app.enqueue(other, "step", {}, after=[After(bad, "run")])  # not committed
        conn.execute(
            "UPDATE leasework.runs SET status = 'failed', finished_at = leasework.now()"
            " WHERE id = %s",
            (bad,),
        )
        deps.settle(conn, 100)  # the parent's end, handled while the child is uncommitted
        other.commit()
    deps.settle(conn, 100)  # the child's own inbox row: its parent ended, decided now
    assert status(conn, child) == "queued"


def test_the_enqueue_role_sets_an_own_policy(app: App, conn: Conn, roles: Any) -> None:  # noqa: F811
    web_dsn = roles("leasework_enqueue")
    with psycopg.connect(web_dsn, autocommit=True) as web:
        bad = app.enqueue(web, "step", {"fail": True}, max_attempts=1)
        child = app.enqueue(web, "step", {}, after=[After(bad, "run")])
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="another transaction"):
            web.execute("SELECT leasework.set_dependency_policy(%s, %s, 'cancel')", (child, bad))
    assert edges(conn, child) == {bad: True}
    drain(app, conn)
    assert statuses(conn, bad, child) == ["failed", "succeeded"]
