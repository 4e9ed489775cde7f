"""A run that joins an open batch while the deps stage decides the batch's callback (docs/workflows.md,
"Batches"). The join locks the callback's row, and the deps step locks it SKIP LOCKED; but a step
whose snapshot was taken before the join committed, and whose lock came after it, read the edges
from that older snapshot: the callback was queued without the new member, which was still
running (issue 32). The deps stage now locks the children in one statement and decides them in
another, whose snapshot is taken after the lock: a join committed before the lock is read, and
one after it waits for the step's commit and finds the batch closed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from leasework import App, Context
from leasework.leases import lease
from leasework.stages import deps
from leasework.testing import drain

from ..conftest import wait_for

Conn = psycopg.Connection[Any]
ROLES = Path(__file__).resolve().parents[2] / "deploy" / "roles.sql"
GATE = 774_213  # the advisory lock that holds the deps step where it reads the edges
LATER = 774_214  # the one that holds it there once the gate has been moved (move_gate)


def status(conn: Conn, run_id: int) -> str:
    row = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return str(row[0])


def make_app(seen: list[Any]) -> App:
    app = App()

    @app.task("work")
    def work(ctx: Context, payload: Any) -> Any:
        return {"n": payload["n"]}

    @app.task("callback")
    def callback(ctx: Context, payload: Any) -> None:
        parents = ctx.parents()
        seen.append((parents.counts, sorted(p.id for p in parents.members)))

    return app


@pytest.fixture
def gated(conn: Conn) -> Iterator[Conn]:
    """Every read of leasework.run_deps by the worker role waits while the advisory lock named
    in public.leasework_test_gate is held (a row-level security policy, in the test database
    only; the owner and superusers are not subject to it, so an enqueue or a join is not held).
    The deps stage reads the edges first in the statement that finds a parent's children, after
    that statement's snapshot and before its row locks, and again when it decides them."""
    conn.execute(ROLES.read_text())  # the deps stage runs under the worker role, as deployed
    conn.execute("CREATE TABLE public.leasework_test_gate (key bigint NOT NULL)")
    conn.execute("INSERT INTO public.leasework_test_gate VALUES (%s)", (GATE,))
    conn.execute(
        """CREATE FUNCTION public.leasework_test_edge_gate() RETURNS boolean
        LANGUAGE plpgsql VOLATILE SECURITY DEFINER AS $$
        DECLARE
            k bigint := (SELECT key FROM public.leasework_test_gate);
        BEGIN
            PERFORM pg_advisory_lock_shared(k);
            PERFORM pg_advisory_unlock_shared(k);
            RETURN true;
        END $$"""
    )
    conn.execute("ALTER TABLE leasework.run_deps ENABLE ROW LEVEL SECURITY")
    conn.execute(
        "CREATE POLICY leasework_test_edge_gate ON leasework.run_deps FOR SELECT"
        " TO leasework_worker USING (public.leasework_test_edge_gate())"
    )
    try:
        yield conn
    finally:
        conn.execute("SELECT pg_advisory_unlock_all()")
        conn.execute("DROP POLICY IF EXISTS leasework_test_edge_gate ON leasework.run_deps")
        conn.execute("ALTER TABLE leasework.run_deps DISABLE ROW LEVEL SECURITY")
        conn.execute("DROP FUNCTION IF EXISTS public.leasework_test_edge_gate()")
        conn.execute("DROP TABLE IF EXISTS public.leasework_test_gate")


def waiting_on(conn: Conn, pid: int, key: int) -> bool:
    """Whether backend `pid` waits for the advisory lock `key`."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'advisory'"
        " AND NOT granted AND objid = %s",
        (pid, key),
    ).fetchone()
    return row is not None and row[0] > 0


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """`fn` on a thread; the list gets its return value or what it raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # read by the caller
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def batch_with_its_last_member_ended(app: App, conn: Conn) -> tuple[int, int]:
    """A closed batch of one member, which has ended: (member, callback)."""
    batch = app.batch("callback", {})
    first = batch.add(conn, "work", {"n": 1})
    callback_id = batch.close(conn)
    held = lease.claim_runs(conn, ["work"], worker="w", lease=30.0)
    assert [c.id for c in held] == [first]
    assert lease.finish(conn, held[0], "succeeded")
    return first, callback_id


def test_a_join_committed_after_the_decide_snapshot_is_counted(gated: Conn, dsn: str) -> None:
    """The interleaving of issue 32: the deps step for the batch's last member takes its snapshot
    and is held (the gate) before it locks the callback; a run joins the batch from outside it
    and commits; the step goes on. Before the fix the step locked the callback (the join's lock
    was gone) and decided it by the edges of its older snapshot: `queued`, the late member still
    queued. Now the callback stays blocked until the late member has ended, and fires once with
    both members counted."""
    conn = gated
    seen: list[Any] = []
    app = make_app(seen)
    first, callback_id = batch_with_its_last_member_ended(app, conn)
    conn.execute("SELECT pg_advisory_lock(%s)", (GATE,))
    with (
        psycopg.connect(dsn, autocommit=True) as stage,
        psycopg.connect(dsn, autocommit=True) as joining,
    ):
        stage.execute("SET ROLE leasework_worker")
        thread, out = in_background(lambda: deps.settle(stage, 100))
        wait_for(lambda: waiting_on(conn, stage.info.backend_pid, GATE), timeout=30)
        # A run joins the open batch from outside it, and commits.
        late = app.batch_of(callback_id).add(joining, "work", {"n": 2})
        conn.execute("SELECT pg_advisory_unlock(%s)", (GATE,))
        thread.join(60)
        assert not thread.is_alive() and out == [1], out
    assert status(conn, late) == "queued"
    assert status(conn, callback_id) == "blocked", "the callback fired before its late member"
    drain(app, conn)
    assert [status(conn, r) for r in (first, late, callback_id)] == ["succeeded"] * 3
    assert seen == [
        ({"succeeded": 2, "partial": 0, "failed": 0, "cancelled": 0}, sorted([first, late]))
    ]


def test_a_join_after_the_lock_finds_the_batch_closed(gated: Conn, dsn: str) -> None:
    """The other side: the step has locked the callback and is held where it decides it; a run
    joining now waits for the callback's row, and once the step commits finds the batch closed
    (its transaction, the member's enqueue with it, rolled back). The callback fires once, with
    the members it was decided with."""
    conn = gated
    seen: list[Any] = []
    app = make_app(seen)
    first, callback_id = batch_with_its_last_member_ended(app, conn)
    conn.execute("SELECT pg_advisory_lock(%s)", (GATE,))
    conn.execute("SELECT pg_advisory_lock(%s)", (LATER,))
    with (
        psycopg.connect(dsn, autocommit=True) as stage,
        psycopg.connect(dsn, autocommit=True) as joining,
    ):
        stage.execute("SET ROLE leasework_worker")
        step, stepped = in_background(lambda: deps.settle(stage, 100))
        wait_for(lambda: waiting_on(conn, stage.info.backend_pid, GATE), timeout=30)
        conn.execute("UPDATE public.leasework_test_gate SET key = %s", (LATER,))
        conn.execute("SELECT pg_advisory_unlock(%s)", (GATE,))
        # Past the lock: held at the next read of the edges, the decision's.
        wait_for(lambda: waiting_on(conn, stage.info.backend_pid, LATER), timeout=30)
        join, joined = in_background(
            lambda: app.batch_of(callback_id).add(joining, "work", {"n": 2})
        )

        def join_waits_for_the_row() -> bool:
            row = conn.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                (joining.info.backend_pid,),
            ).fetchone()
            return row is not None and row[0] == "Lock"

        wait_for(join_waits_for_the_row, timeout=30)
        conn.execute("SELECT pg_advisory_unlock(%s)", (LATER,))
        step.join(60)
        join.join(60)
        assert not step.is_alive() and stepped == [1], stepped
        assert not join.is_alive() and len(joined) == 1
    assert isinstance(joined[0], psycopg.errors.InvalidParameterValue), joined
    assert f"batch {callback_id} is closed: its callback is queued" in str(joined[0])
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (2,)
    drain(app, conn)
    assert [status(conn, r) for r in (first, callback_id)] == ["succeeded"] * 2
    assert seen == [({"succeeded": 1, "partial": 0, "failed": 0, "cancelled": 0}, [first])]
