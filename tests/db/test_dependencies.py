"""Dependencies (docs/workflows.md): a run enqueued with `after` waits (`blocked`) until every
run it waits for has ended, then the deps stage makes it `queued` or, by its policy, `cancelled`;
exactly once, whatever order its parents' ends commit in, and never waiting on a row lock. A run
without dependencies fires nothing."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from leasework import App, Client, ConfigError, Context
from leasework.leases import lease
from leasework.stages import deps
from leasework.testing import drain
from tests.conftest import shift_clock, truncate_all

Conn = psycopg.Connection[Any]


def status(conn: Conn, run_id: int) -> str:
    row = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return str(row[0])


def statuses(conn: Conn, *ids: int) -> list[str]:
    return [status(conn, i) for i in ids]


def make_app(log: list[tuple[str, Any]]) -> App:
    app = App()

    @app.task("step")
    def step(ctx: Context, payload: Any) -> Any:
        parents = ctx.parents()
        log.append((payload["name"], [(p.id, p.status, p.result) for p in parents]))
        if payload.get("fail"):
            raise RuntimeError(f"{payload['name']} fails")
        return {"name": payload["name"]}

    return app


@pytest.fixture
def log() -> list[tuple[str, Any]]:
    return []


@pytest.fixture
def app(log: list[tuple[str, Any]]) -> App:
    return make_app(log)


def claim(conn: Conn, kind: str = "step") -> lease.Claim:
    got = lease.claim_runs(conn, [kind], worker="test-worker", lease=30.0)
    assert len(got) == 1, got
    return got[0]


def test_a_chain_runs_in_order_and_each_handler_reads_its_parents(
    app: App, conn: Conn, log: list[tuple[str, Any]]
) -> None:
    with conn.transaction():
        a = app.enqueue(conn, "step", {"name": "a"})
        b = app.enqueue(conn, "step", {"name": "b"}, after=[a])
        c = app.enqueue(conn, "step", {"name": "c"}, after=[b])
    assert statuses(conn, a, b, c) == ["queued", "blocked", "blocked"]
    drain(app, conn)
    assert [name for name, _ in log] == ["a", "b", "c"]
    assert log[1] == ("b", [(a, "succeeded", {"name": "a"})])
    assert log[2] == ("c", [(b, "succeeded", {"name": "b"})])
    assert statuses(conn, a, b, c) == ["succeeded"] * 3


def test_a_run_waits_for_every_parent(app: App, conn: Conn, log: list[tuple[str, Any]]) -> None:
    a = app.enqueue(conn, "step", {"name": "a"})
    b = app.enqueue(conn, "step", {"name": "b"})
    j = app.enqueue(conn, "step", {"name": "j"}, after=[a, b])
    first = claim(conn)
    assert lease.finish(conn, first, "succeeded")
    deps.settle(conn, 100)
    assert status(conn, j) == "blocked"  # b has not ended
    second = claim(conn)
    assert lease.finish(conn, second, "succeeded")
    deps.settle(conn, 100)
    assert status(conn, j) == "queued"
    drain(app, conn)
    assert log[-1][0] == "j" and sorted(p[0] for p in log[-1][1]) == [a, b]


def test_a_failed_parent_cancels_what_waits_on_it_down_the_chain(app: App, conn: Conn) -> None:
    with conn.transaction():
        a = app.enqueue(conn, "step", {"name": "a", "fail": True}, max_attempts=1)
        b = app.enqueue(conn, "step", {"name": "b"}, after=[a])
        c = app.enqueue(conn, "step", {"name": "c"}, after=[b])
        d = app.enqueue(conn, "step", {"name": "d"}, after=[a], on_parent_failure="run")
    drain(app, conn)
    assert statuses(conn, a, b, c, d) == ["failed", "cancelled", "cancelled", "succeeded"]
    row = conn.execute("SELECT error, finished_at FROM leasework.runs WHERE id = %s", (b,)).fetchone()
    assert row is not None and row[0] == f"run {a}, which it waited for, ended failed"
    assert row[1] is not None
    row = conn.execute("SELECT error FROM leasework.runs WHERE id = %s", (c,)).fetchone()
    assert row is not None and row[0] == f"run {b}, which it waited for, ended cancelled"


def test_the_policy_run_anyway_sees_the_failed_parent(
    app: App, conn: Conn, log: list[tuple[str, Any]]
) -> None:
    a = app.enqueue(conn, "step", {"name": "a", "fail": True}, max_attempts=1)
    b = app.enqueue(conn, "step", {"name": "b"}, after=[a], on_parent_failure="run")
    drain(app, conn)
    assert status(conn, b) == "succeeded"
    assert log[-1] == ("b", [(a, "failed", None)])


def test_cancelling_a_run_cancels_what_waits_on_it_by_policy(app: App, conn: Conn) -> None:
    a = app.enqueue(conn, "step", {"name": "a"})
    b = app.enqueue(conn, "step", {"name": "b"}, after=[a])
    c = app.enqueue(conn, "step", {"name": "c"}, after=[b])
    keep = app.enqueue(conn, "step", {"name": "keep"}, after=[b], on_parent_failure="run")
    assert app.cancel(conn, b) == "cancelled"  # a blocked run is cancelled at once
    deps.settle(conn, 100)
    deps.settle(conn, 100)
    assert statuses(conn, a, b, c, keep) == ["queued", "cancelled", "cancelled", "queued"]


def test_a_parent_that_already_ended_counts_at_once(app: App, conn: Conn) -> None:
    ok = app.enqueue(conn, "step", {"name": "ok"})
    bad = app.enqueue(conn, "step", {"name": "bad"})
    lease.finish(conn, claim(conn), "succeeded")
    lease.finish(conn, claim(conn), "failed", error="no")
    conn.execute("LISTEN leasework")
    after_ok = app.enqueue(conn, "step", {"name": "x"}, after=[ok])
    after_bad = app.enqueue(conn, "step", {"name": "y"}, after=[ok, bad])
    anyway = app.enqueue(conn, "step", {"name": "z"}, after=[bad], on_parent_failure="run")
    assert statuses(conn, after_ok, after_bad, anyway) == ["queued", "cancelled", "queued"]
    assert {n.payload for n in conn.notifies(timeout=1, stop_after=1)} == {"step"}
    assert conn.execute("SELECT count(*) FROM leasework.run_deps_ended").fetchone() == (0,)


def test_a_parent_running_elsewhere_is_watched_through_the_stage(app: App, conn: Conn) -> None:
    """The enqueue does not lock a parent it did not make (its worker would wait on the lock
    until the enqueue commits): it leaves a row for the deps stage, which marks the parent. A
    parent that ends before the stage marks it (its end fired nothing) is found ended there."""
    p = app.enqueue(conn, "step", {"name": "p"})
    q = app.enqueue(conn, "step", {"name": "q"})
    held_p, held_q = claim(conn), claim(conn)
    child_p = app.enqueue(conn, "step", {"name": "cp"}, after=[p])
    child_q = app.enqueue(conn, "step", {"name": "cq"}, after=[q])
    flags = conn.execute(
        "SELECT has_dependents FROM leasework.runs WHERE id IN (%s, %s)", (p, q)
    ).fetchall()
    assert flags == [(False,), (False,)]
    # p ends before the stage ran: its end records nothing, the stage finds it ended
    assert lease.finish(conn, held_p, "succeeded")
    deps.settle(conn, 100)
    assert statuses(conn, child_p, child_q) == ["queued", "blocked"]
    # q was marked by that step: its end records itself
    assert conn.execute("SELECT has_dependents FROM leasework.runs WHERE id = %s", (q,)).fetchone() == (True,)
    assert conn.execute("SELECT count(*) FROM leasework.run_deps_ended").fetchone() == (0,)
    assert lease.finish(conn, held_q, "succeeded")
    assert conn.execute("SELECT parent FROM leasework.run_deps_ended").fetchall() == [(q,)]
    deps.settle(conn, 100)
    assert status(conn, child_q) == "queued"


def test_parents_ending_in_two_transactions_make_the_child_due_once(
    app: App, conn: Conn, dsn: str
) -> None:
    """The step that reads the first end before the second commits leaves the child blocked; the
    second end's row, committed with it, decides it. A child whose row someone holds is left (not
    waited on) with its parent's row kept for the next step."""
    with conn.transaction():
        a = app.enqueue(conn, "step", {"name": "a"})
        b = app.enqueue(conn, "step", {"name": "b"})
        j = app.enqueue(conn, "step", {"name": "j"}, after=[a, b])
    ca, cb = claim(conn), claim(conn)
    assert lease.finish(conn, ca, "succeeded")
    with psycopg.connect(dsn) as other:  # b's seal, not yet committed
        assert lease.finish(other, cb, "succeeded")
        assert deps.settle(conn, 100) == 1
        assert status(conn, j) == "blocked"
        other.commit()
    with psycopg.connect(dsn) as holder:  # someone holds the child's row
        holder.execute("SELECT 1 FROM leasework.runs WHERE id = %s FOR UPDATE", (j,))
        skipped: list[int] = []
        assert deps.settle(conn, 100, skipped) == 0
        assert skipped == [b]  # the stage asks again at the next poll (DepsStage.next_due)
        assert status(conn, j) == "blocked"
        holder.rollback()
    conn.execute("LISTEN leasework")
    assert deps.settle(conn, 100) == 1
    assert status(conn, j) == "queued"
    assert [n.payload for n in conn.notifies(timeout=1, stop_after=1)] == ["step"]
    assert deps.settle(conn, 100) == 0


def test_a_seal_never_waits_on_the_deps_stage_nor_on_an_open_enqueue(
    app: App, conn: Conn, dsn: str
) -> None:
    """An enqueue after a running run, left open, holds no lock its worker's seal needs."""
    p = app.enqueue(conn, "step", {"name": "p"})
    held = claim(conn)
    with psycopg.connect(dsn) as web:
        web.execute("SET lock_timeout = '2s'")
        Client().enqueue(web, "step", {"name": "c"}, after=[p])  # open transaction
        conn.execute("SET lock_timeout = '2s'")
        assert lease.finish(conn, held, "succeeded")
        web.commit()
    deps.settle(conn, 100)
    assert conn.execute(
        "SELECT status FROM leasework.runs WHERE kind = 'step' ORDER BY id"
    ).fetchall() == [("succeeded",), ("queued",)]


def test_a_promoted_run_keeps_its_delay_and_its_tenant_is_in_turn(app: App, conn: Conn) -> None:
    a = app.enqueue(conn, "step", {"name": "a"}, tenant="t1")
    b = app.enqueue(conn, "step", {"name": "b"}, after=[a], tenant="t2", delay=60)
    lease.finish(conn, claim(conn), "succeeded")
    deps.settle(conn, 100)
    assert status(conn, b) == "queued"
    assert lease.claim_runs(conn, ["step"], worker="w", lease=30.0) == []  # not due yet
    assert conn.execute(
        "SELECT priority IS NOT NULL FROM leasework.tenants WHERE name = 't2'"
    ).fetchone() == (True,)
    shift_clock(conn, 61)
    got = lease.claim_runs(conn, ["step"], worker="w", lease=30.0)
    assert [c.id for c in got] == [b]


def test_runs_without_dependencies_fire_nothing(app: App, conn: Conn) -> None:
    """Enqueue, claim and seal of runs nothing waits for: the trigger's WHEN is false, nothing
    recorded, and the function is never called."""
    conn.execute("SET track_functions = 'all'")
    before = conn.execute(
        "SELECT coalesce((SELECT calls FROM pg_stat_user_functions"
        " WHERE schemaname = 'leasework' AND funcname = 'run_ended'), 0)"
    ).fetchone()
    ids = [app.enqueue(conn, "step", {"name": str(i)}) for i in range(5)]
    app.enqueue_many(conn, "step", [{"name": "m"}] * 3)
    drain(app, conn)
    assert all(s == "succeeded" for s in statuses(conn, *ids))
    conn.execute("SELECT pg_stat_force_next_flush()")
    after = conn.execute(
        "SELECT coalesce((SELECT calls FROM pg_stat_user_functions"
        " WHERE schemaname = 'leasework' AND funcname = 'run_ended'), 0)"
    ).fetchone()
    assert after == before
    assert conn.execute("SELECT count(*) FROM leasework.run_deps_ended").fetchone() == (0,)
    assert conn.execute(
        "SELECT count(*) FROM leasework.runs WHERE has_dependents"
    ).fetchone() == (0,)


def test_enqueue_many_after(app: App, conn: Conn) -> None:
    a = app.enqueue(conn, "step", {"name": "a"})
    ids = app.enqueue_many(conn, "step", [{"name": "x"}, {"name": "y"}], after=[a])
    assert statuses(conn, *ids) == ["blocked", "blocked"]
    drain(app, conn)
    assert statuses(conn, a, *ids) == ["succeeded"] * 3


def test_a_typed_enqueue_takes_after(conn: Conn) -> None:
    app = App()

    @app.task("typed")
    def typed(ctx: Context, *, n: int) -> int:
        return n

    a = typed.enqueue(conn, n=1)
    b = typed.configure(after=[a]).enqueue(conn, n=2)
    assert statuses(conn, a, b) == ["queued", "blocked"]


@pytest.mark.parametrize(
    ("options", "line"),
    [
        ({"after": [1], "key": "k"}, "after cannot be combined with key, exclusive, unique_for"),
        ({"after": [1], "unique_for": 5, "key": "k"}, "after cannot be combined with key"),
        ({"after": "1"}, "after must be a list of run ids, got str"),
        ({"after": [0]}, "after must be a list of run ids (positive integers), got 0"),
        ({"after": [1], "on_parent_failure": "skip"}, "on_parent_failure must be 'cancel', 'run' or 'batch'"),
        ({"on_parent_failure": "run"}, "on_parent_failure needs after"),
    ],
)
def test_bad_dependencies_are_refused_in_one_line(
    app: App, conn: Conn, options: dict[str, Any], line: str
) -> None:
    app.enqueue(conn, "step", {"name": "a"})
    with pytest.raises(ConfigError) as err:
        app.enqueue(conn, "step", {}, **options)
    assert line in str(err.value) and "\n" not in str(err.value)
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (1,)


def test_a_run_can_only_wait_for_runs_that_exist(app: App, conn: Conn) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue) as err:
        app.enqueue(conn, "step", {}, after=[424242])
    assert "after: there is no run 424242 (a run can only wait for runs that exist)" in str(err.value)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="holds no key"):
        conn.execute("SELECT leasework.enqueue('step', key => 'k', after => '{1}')")
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (0,)


def test_sql_enqueue_after(conn: Conn) -> None:
    a = conn.execute("SELECT leasework.enqueue('step')").fetchone()[0]  # type: ignore[index]
    b = conn.execute(
        "SELECT leasework.enqueue('step', after => ARRAY[%s]::bigint[], on_parent_failure => 'run')",
        (a,),
    ).fetchone()[0]  # type: ignore[index]
    assert statuses(conn, a, b) == ["queued", "blocked"]
    assert conn.execute("SELECT anyway FROM leasework.run_deps WHERE child = %s", (b,)).fetchone() == (True,)


def test_a_parent_pruned_before_its_child_was_decided_counts_as_ended(app: App, conn: Conn) -> None:
    a = app.enqueue(conn, "step", {"name": "a"})
    b = app.enqueue(conn, "step", {"name": "b"})
    j = app.enqueue(conn, "step", {"name": "j"}, after=[a, b])
    lease.finish(conn, claim(conn), "succeeded")
    deps.settle(conn, 100)
    conn.execute("DELETE FROM leasework.runs WHERE id = %s", (a,))
    lease.finish(conn, claim(conn), "succeeded")
    deps.settle(conn, 100)
    assert status(conn, j) == "queued"


def test_a_worker_decides_what_waits_when_woken(app: App, conn: Conn, make_worker: Any) -> None:
    """The deps stage is in every app's poll, woken by its NOTIFY."""
    assert "deps" in [s.name for s in app.stages()]
    with conn.transaction():
        a = app.enqueue(conn, "step", {"name": "a"})
        b = app.enqueue(conn, "step", {"name": "b"}, after=[a])
    worker = make_worker(app)
    for _ in range(20):
        worker.poll()
        if status(conn, b) == "succeeded":
            break
    assert statuses(conn, a, b) == ["succeeded", "succeeded"]


def test_concurrent_steps_decide_each_child_once(app: App, conn: Conn, dsn: str) -> None:
    with conn.transaction():
        roots = [app.enqueue(conn, "step", {"name": f"r{i}"}) for i in range(6)]
        kids = [app.enqueue(conn, "step", {"name": f"k{i}"}, after=roots) for i in range(30)]
    for _ in roots:
        lease.finish(conn, claim(conn), "succeeded")
    decided: list[int] = []

    def step() -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            for _ in range(10):
                decided.append(deps.settle(c, 2))

    threads = [threading.Thread(target=step) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deps.settle(conn, 100)
    assert statuses(conn, *kids) == ["queued"] * 30
    assert conn.execute("SELECT count(*) FROM leasework.run_deps_ended").fetchone() == (0,)


def test_an_async_handler_awaits_its_parents(conn: Conn) -> None:
    app = App()
    got: list[Any] = []

    @app.task("first")
    def first(ctx: Context, payload: Any) -> Any:
        return {"x": 1}

    @app.task("second")
    async def second(ctx: Any, payload: Any) -> None:
        parents = await ctx.parents()
        got.append([(p.kind, p.status, p.result) for p in parents])
        assert await ctx.parents() is parents  # read once

    a = app.enqueue(conn, "first", {})
    app.enqueue(conn, "second", {}, after=[a])
    drain(app, conn)
    assert got == [[("first", "succeeded", {"x": 1})]]


def test_a_deleted_runs_edges_go_with_it(app: App, conn: Conn) -> None:
    a = app.enqueue(conn, "step", {"name": "a"})
    b = app.enqueue(conn, "step", {"name": "b"}, after=[a])
    drain(app, conn)
    assert app.delete(conn, [b]).ids == [b]
    assert conn.execute("SELECT count(*) FROM leasework.run_deps").fetchone() == (0,)


# -- the suite catches a broken deps stage (as tests/db/test_mutations.py does for lease.sql) ----


def _waits_for_every_parent(app: App, conn: Conn) -> None:
    a = app.enqueue(conn, "step", {"name": "a"})
    b = app.enqueue(conn, "step", {"name": "b"})
    j = app.enqueue(conn, "step", {"name": "j"}, after=[a, b])
    lease.finish(conn, claim(conn), "succeeded")
    deps.settle(conn, 100)
    assert status(conn, j) == "blocked"


def _cancel_policy_cancels(app: App, conn: Conn) -> None:
    a = app.enqueue(conn, "step", {"name": "a"})
    b = app.enqueue(conn, "step", {"name": "b"}, after=[a])
    lease.finish(conn, claim(conn), "failed", error="no")
    deps.settle(conn, 100)
    assert status(conn, b) == "cancelled"


def _marked_parent_records_its_end(app: App, conn: Conn) -> None:
    p = app.enqueue(conn, "step", {"name": "p"})
    held = claim(conn)
    child = app.enqueue(conn, "step", {"name": "c"}, after=[p])  # p made elsewhere: marked later
    deps.settle(conn, 100)
    lease.finish(conn, held, "succeeded")
    deps.settle(conn, 100)
    assert status(conn, child) == "queued"


@pytest.mark.parametrize(
    ("query", "remove", "replace", "check"),
    [
        ("decide_children", "WHERE r.id = v.id AND v.open = 0", "WHERE r.id = v.id", _waits_for_every_parent),
        ("decide_children", "WHERE NOT d.anyway AND p.status IN", "WHERE false AND p.status IN", _cancel_policy_cancels),
        ("mark_parent", "SET has_dependents = true", "SET has_dependents = false", _marked_parent_records_its_end),
    ],
)
def test_a_broken_deps_statement_is_caught(
    app: App, conn: Conn, monkeypatch: pytest.MonkeyPatch, query: str, remove: str, replace: str,
    check: Any,
) -> None:
    from importlib import resources

    from leasework.queries import compact, parse

    check(app, conn)
    truncate_all(conn)
    body = parse(resources.files("leasework.stages").joinpath("deps.sql").read_text())[query]
    assert remove in body, "the mutation no longer applies: update this test"
    mutant = compact(body.replace(remove, replace))
    monkeypatch.setitem(deps.Q, query, mutant.encode() if isinstance(deps.Q[query], bytes) else mutant)
    with pytest.raises(AssertionError):
        check(app, conn)


def test_the_end_trigger_fires_at_the_end_only(app: App, conn: Conn, dsn: str) -> None:
    """The one trigger on a run's end (runs_ended) is called for a parent's and a watched run's
    every status write, but records a parent's end and NOTIFYs a watched run's only as it ends:
    its claim records nothing and sends nothing, its seal exactly one of each."""
    parent = app.enqueue(conn, "step", {"name": "p"})
    app.enqueue(conn, "step", {"name": "c"}, after=[parent])
    deps.settle(conn, 100)  # the stage marks the parent has_dependents, and empties its inbox
    conn.execute("SELECT * FROM leasework.run_outcome(%s, true)", (parent,))
    assert conn.execute(
        "SELECT has_dependents, notify_ended FROM leasework.runs WHERE id = %s", (parent,)
    ).fetchone() == (True, True)
    assert conn.execute("SELECT count(*) FROM leasework.run_deps_ended").fetchone() == (0,)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN leasework_ended")
        got = claim(conn)
        assert got.id == parent
        assert conn.execute("SELECT count(*) FROM leasework.run_deps_ended").fetchone() == (0,)
        assert list(listener.notifies(timeout=0.2, stop_after=1)) == []
        lease.finish(conn, got, "succeeded")
        assert conn.execute(
            "SELECT count(*) FROM leasework.run_deps_ended WHERE parent = %s", (parent,)
        ).fetchone() == (1,)
        heard = list(listener.notifies(timeout=10, stop_after=1))
        assert [n.payload for n in heard] == [str(parent)]
