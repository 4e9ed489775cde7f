"""The lease keeper on real Postgres: with its thread on, a handler that never calls ctx.check()
keeps its lease, and a cancel, a timeout or a lost lease interrupts it where it blocks (a sleep,
a query of its own); an interrupted pooled connection is discarded, never reused half-way. The
keeper's give-up rule (renewal failing until 0.9 of the lease) is checked on a moved clock, and
both rules have a mutation that the checks here catch. So is a task's lease shorter than the
worker's, renewed at its own pace (tests/mutants.py plants the worker's pace instead)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import psycopg
import pytest

from leasework import Aborted, App, Config, Context
from leasework.leases import lease
from leasework.workers import keeper as keeper_mod
from leasework.workers.keeper import Keeper
from leasework.workers.worker import Worker

from ..conftest import fast_config, get_run, shift_clock, wait_for
from .test_worker import steal

Conn = psycopg.Connection[Any]
MakeWorker = Callable[..., Worker]
# Short enough that a renewal shows within a second or two, never slept out: the handlers wait on
# the condition they test, with a deadline.
QUICK = {"lease": 3.0, "renew_interval": 0.5, "control_interval": 0.2, "keeper_thread": True}


def lease_expiry(dsn: str, run_id: int) -> datetime | None:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute("SELECT lease_expires_at FROM leasework.runs WHERE id = %s", (run_id,))
        found = row.fetchone()
    return None if found is None else found[0]


def renewed_while_the_handler_blocks(
    make_worker: MakeWorker, conn: Conn, dsn: str, within: float = 8.0
) -> None:
    """A handler that never calls ctx.check() sees its committed lease extended twice within
    `within` s while it blocks, and its run succeeds."""
    app = App()
    seen: list[bool] = []

    @app.task("blocked")
    def blocked(ctx: Context, payload: Any) -> None:
        first = lease_expiry(dsn, ctx.run_id)
        assert first is not None
        expiries = {first}
        deadline = time.monotonic() + within
        while len(expiries) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # blocking, never ctx.check()
            expiries.add(lease_expiry(dsn, ctx.run_id) or first)
        seen.append(len(expiries) >= 3 and max(expiries) > first)

    run_id = app.enqueue(conn, "blocked")
    make_worker(app, **QUICK).poll()
    assert seen == [True], "the lease was not renewed while the handler blocked"
    assert get_run(conn, run_id)["status"] == "succeeded"


def test_the_keeper_renews_a_lease_while_the_handler_blocks(
    make_worker: MakeWorker, conn: Conn, dsn: str
) -> None:
    renewed_while_the_handler_blocks(make_worker, conn, dsn)


def test_without_the_keeper_thread_the_blocked_handler_is_caught(
    monkeypatch: pytest.MonkeyPatch, make_worker: MakeWorker, conn: Conn, dsn: str
) -> None:
    """The mutation: handler-independent renewal turned off (the keeper's thread never starts,
    so leases are renewed only in ctx.check()). The check above must fail. Mutated, the handler
    can only wait its window out: 3 s, six renewal intervals (two renewals are due in one
    second) and the whole lease, rather than the check's generous 8 s."""
    monkeypatch.setattr(Keeper, "start", lambda self: None)
    with pytest.raises(AssertionError, match="not renewed"):
        renewed_while_the_handler_blocks(make_worker, conn, dsn, within=3.0)


def when_running(conn: Conn, run_id: int, act: Callable[[], Any]) -> threading.Thread:
    """In the background: once the run is running, do `act` (as another process would)."""

    def go() -> None:
        wait_for(lambda: get_run(conn, run_id)["status"] == "running", timeout=20)
        act()

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def test_a_cancel_interrupts_a_handler_blocked_in_a_sleep(
    make_worker: MakeWorker, conn: Conn, dsn: str
) -> None:
    app = App()
    aborted: list[tuple[str, float]] = []

    @app.task("sleepy")
    def sleepy(ctx: Context, payload: Any) -> None:
        started = time.monotonic()
        try:
            time.sleep(60)
        except Aborted as exc:
            aborted.append((exc.reason, time.monotonic() - started))
            raise

    run_id = app.enqueue(conn, "sleepy")
    with psycopg.connect(dsn, autocommit=True) as other:
        canceller = when_running(other, run_id, lambda: App().cancel(other, run_id))
        make_worker(app, **QUICK).poll()
        canceller.join(5)
    [(reason, took)] = aborted
    assert reason == "cancelled" and took < 30
    row = get_run(conn, run_id)
    assert row["status"] == "cancelled" and row["history"][-1]["outcome"] == "cancelled"


def test_a_timeout_interrupts_a_handler_blocked_in_a_sleep(
    make_worker: MakeWorker, conn: Conn
) -> None:
    app = App()

    @app.task("sleepy", timeout=0.5)
    def sleepy(ctx: Context, payload: Any) -> None:
        time.sleep(60)

    run_id = app.enqueue(conn, "sleepy")
    started = time.monotonic()
    make_worker(app, **QUICK).poll()
    assert time.monotonic() - started < 30
    row = get_run(conn, run_id)
    assert row["status"] == "queued" and row["attempts"] == 1
    assert row["history"][-1]["outcome"] == "timeout"
    assert row["error"] == "timeout after 0.5 s"


def test_a_lost_lease_interrupts_the_handler_and_nothing_is_written(
    make_worker: MakeWorker, conn: Conn, dsn: str
) -> None:
    app = App()
    aborted: list[str] = []

    @app.task("job")
    def job(ctx: Context, payload: Any) -> dict[str, str]:
        try:
            time.sleep(60)
        except Aborted as exc:
            aborted.append(exc.reason)
            raise
        return {"written": "by a stale worker"}

    run_id = app.enqueue(conn, "job")
    thief: list[lease.Claim] = []
    with psycopg.connect(dsn, autocommit=True) as other:
        stealer = when_running(other, run_id, lambda: thief.append(steal(dsn, run_id)))
        make_worker(app, **QUICK).poll()
        stealer.join(5)
    assert aborted == ["lost"]
    row = get_run(conn, run_id)
    assert row["status"] == "running" and row["lease_owner"] == thief[0].owner
    assert row["result"] is None


def test_an_interrupted_query_of_the_handler_is_cancelled_and_its_connection_dropped(
    make_worker: MakeWorker, conn: Conn, dsn: str
) -> None:
    app = App()
    outcomes: list[str] = []

    @app.task("stuck_query")
    def stuck_query(ctx: Context, payload: Any) -> None:
        with ctx.transaction() as c:
            c.execute("SELECT pg_sleep(60) /* stuck_query */")

    @app.task("after")
    def after(ctx: Context, payload: Any) -> None:
        with ctx.transaction() as c:  # the pool must hand out a clean connection
            outcomes.append(str(c.info.transaction_status.name))
            c.execute("SELECT 1")
        with ctx.connection() as c:
            c.execute("SELECT 1")

    run_id = app.enqueue(conn, "stuck_query")
    worker = make_worker(app, pool_size=2, **QUICK)  # a pool of one: the same connection again
    with psycopg.connect(dsn, autocommit=True) as other:
        canceller = when_running(other, run_id, lambda: App().cancel(other, run_id))
        worker.poll()
        canceller.join(5)
    assert get_run(conn, run_id)["status"] == "cancelled"
    # The server stopped the query (cancelled with the connection), so it holds no lock.
    wait_for(
        lambda: (
            conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE query LIKE %s AND pid <> pg_backend_pid()",
                ("%/* stuck_query */%",),
            ).fetchone()
            == (0,)
        )
    )
    next_id = app.enqueue(conn, "after")
    worker.poll()
    assert get_run(conn, next_id)["status"] == "succeeded", get_run(conn, next_id)["error"]
    assert outcomes == ["INTRANS"]


# -- the give-up rule, on a moved clock -------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def unreachable_dsn() -> str:
    import socket

    with socket.socket() as s:  # a port nothing listens on: connections are refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"host=127.0.0.1 port={port} dbname=none user=none connect_timeout=2"


def gives_up_before_the_lease_could_expire(claim: lease.Claim) -> None:
    """Renewal failing since the claim: the run stays ours until 0.9 of its lease has passed
    (the database cannot have expired it yet), and is lost from then on, before it expires."""
    clock = Clock()
    cfg = Config(dsn=unreachable_dsn(), lease=claim.lease_seconds)
    keeper = Keeper(cfg, name="t", clock=clock)
    held = keeper.hold(claim)
    try:
        clock.t += claim.lease_seconds * 0.85
        keeper.tend()
        assert not held.signal.tripped, "gave up while the lease was surely still ours"
        clock.t += claim.lease_seconds * 0.1  # 0.95 of the lease
        keeper.tend()
        assert held.signal.reason == "lost", "renewal kept failing past 0.9 of the lease"
    finally:
        keeper.close()


def a_claim(conn: Conn) -> lease.Claim:
    app = App()
    app.task("job", lease=30)(lambda ctx, payload: None)
    app.enqueue(conn, "job")
    [claim] = lease.claim_runs(conn, ["job"], worker="w", lease=30.0)
    return claim


def test_the_keeper_gives_up_at_nine_tenths_of_the_lease(conn: Conn) -> None:
    gives_up_before_the_lease_could_expire(a_claim(conn))


def test_giving_up_later_than_the_lease_is_caught(
    monkeypatch: pytest.MonkeyPatch, conn: Conn
) -> None:
    """The mutation: the keeper gives up at 1.5 x the lease, after the database expired it."""
    monkeypatch.setattr(keeper_mod, "GIVE_UP_AT", 1.5)
    with pytest.raises(AssertionError, match=r"past 0\.9"):
        gives_up_before_the_lease_could_expire(a_claim(conn))


def a_shorter_lease_never_lapses(conn: Conn, dsn: str) -> None:
    """A task's own lease (3 s) shorter than the worker's (30 s, renewed every 10 s): the keeper
    renews it at the pace scaled to its lease (every 1 s), not the worker's. On a moved clock,
    the keeper's and the database's moved together a quarter of a second per tick over four of
    its leases, the committed lease never lapses before the next tick and is never given up."""
    app = App()
    app.task("short", lease=3)(lambda ctx, payload: None)
    run_id = app.enqueue(conn, "short")
    [claim] = lease.claim_runs(conn, ["short"], worker="w", lease=30.0)
    assert claim.lease_seconds == 3.0
    clock = Clock()
    start = clock.t
    keeper = Keeper(fast_config(dsn, lease=30.0, renew_interval=10.0), name="t", clock=clock)
    held = keeper.hold(claim)
    renewals = 0
    try:
        for tick in range(1, 49):
            elapsed = tick * 0.25
            clock.t = start + elapsed
            for c in (conn, keeper.connection()):
                shift_clock(c, elapsed)
            row = conn.execute(
                "SELECT lease_expires_at, lease_expires_at > leasework.now()"
                " FROM leasework.runs WHERE id = %s",
                (run_id,),
            ).fetchone()
            assert row is not None and row[1], (
                f"the run's 3 s lease lapsed {elapsed:g} s after its claim: renewed "
                f"{renewals} times, every {held.timing.renew:g} s"
            )
            before = held.renewed
            keeper.tend()
            renewals += held.renewed != before
            assert not held.signal.tripped, held.signal.reason
        assert renewals >= 10
    finally:
        keeper.close()
        shift_clock(conn, 0)


def test_a_run_with_a_shorter_lease_never_lapses(conn: Conn, dsn: str) -> None:
    a_shorter_lease_never_lapses(conn, dsn)


def late(claim: lease.Claim) -> lease.Claim:
    """The claim as if its answer had arrived a whole lease after the statement was sent (a slow
    network, a stalled process)."""
    return dataclasses.replace(claim, sent=time.monotonic() - claim.lease_seconds)


def test_a_claim_answered_after_its_lease_ran_out_is_never_started(
    make_worker: MakeWorker, conn: Conn, dsn: str
) -> None:
    """Meanwhile the lease ran out and another worker took the run: the late claim must not run
    its handler beside the thief's attempt, nor write anything."""
    app = App()
    ran: list[int] = []
    app.task("job")(lambda ctx, payload: ran.append(ctx.run_id))
    run_id = app.enqueue(conn, "job")
    [claim] = lease.claim_runs(conn, ["job"], worker="slow", lease=30.0)
    thief = steal(dsn, run_id)

    worker = make_worker(app, **QUICK)
    assert worker.executor.run(late(claim), app.handler("job")) is None
    assert ran == [], "a claim answered after its lease ran out was started"
    row = get_run(conn, run_id)
    assert row["status"] == "running" and row["lease_owner"] == thief.owner


def test_a_late_claim_still_ours_is_renewed_before_it_starts(
    make_worker: MakeWorker, conn: Conn
) -> None:
    app = App()
    app.task("job")(lambda ctx, payload: None)
    run_id = app.enqueue(conn, "job")
    [claim] = lease.claim_runs(conn, ["job"], worker="slow", lease=30.0)
    before = conn.execute(
        "SELECT lease_expires_at FROM leasework.runs WHERE id = %s", (run_id,)
    ).fetchone()

    worker = make_worker(app, **QUICK)
    held = worker.keeper.hold(late(claim), sent=late(claim).sent)
    assert held.renewed > late(claim).sent, "a late claim was not confirmed before its start"
    after = conn.execute(
        "SELECT lease_expires_at FROM leasework.runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert before is not None and after is not None and after[0] > before[0]
    assert worker.executor.run(claim, app.handler("job")) == "succeeded"
    assert get_run(conn, run_id)["status"] == "succeeded"


def test_a_late_batch_is_confirmed_in_one_statement_and_its_lost_run_never_started(
    make_worker: MakeWorker, conn: Conn, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch claim answered a lease late (Keeper.hold_many): every run of it is confirmed
    before any starts, in one statement; the run another worker took meanwhile is never started
    and nothing is written for it, the others are renewed and run."""
    app = App()
    ran: list[int] = []
    app.task("job", batch=3)(lambda ctx, payload: ran.append(ctx.run_id))
    ids = [app.enqueue(conn, "job") for _ in range(3)]
    claims = lease.claim_runs(conn, ["job"], worker="slow", lease=30.0, limit=3)
    assert sorted(c.id for c in claims) == sorted(ids)
    thief = steal(dsn, ids[1])
    worker = make_worker(app)
    tended: list[int] = []
    real_tend = lease.tend

    def counted(c: Conn, due: Any) -> Any:
        tended.append(len(due))
        return real_tend(c, due)

    monkeypatch.setattr(lease, "tend", counted)
    assert worker.executor.run_batch([late(c) for c in claims], app.handler("job")) == 3
    assert tended[:1] == [3], "a late batch was not confirmed in one statement"
    assert sorted(ran) == sorted([ids[0], ids[2]])
    stolen = get_run(conn, ids[1])
    assert stolen["status"] == "running" and stolen["lease_owner"] == thief.owner
    assert [get_run(conn, i)["status"] for i in (ids[0], ids[2])] == ["succeeded"] * 2


def test_a_handler_told_by_check_is_not_interrupted_again_while_it_cleans_up(
    make_worker: MakeWorker, conn: Conn
) -> None:
    """The keeper interrupts a handler at most once, and not at all once `ctx.check()` has told
    it: a handler that catches the `Aborted` of its check and writes its last effect is not hit
    by the keeper's signal landing a moment later (the supervisor's SIGSTOP test saw this race:
    the cleanup's fenced write never got to be refused)."""
    app = App()
    seen: list[str] = []

    @app.task("tidy")
    def tidy(ctx: Context, payload: Any) -> dict[str, str]:
        ctx.held.signal.trip("cancelled")
        try:
            ctx.check()
        except Aborted as exc:
            seen.append(exc.reason)
        ctx.interrupt()  # what the keeper's signal runs in the main thread: must not raise now
        seen.append("cleaned up")
        raise Aborted("cancelled")

    run_id = app.enqueue(conn, "tidy")
    make_worker(app, **QUICK).poll()
    assert seen == ["cancelled", "cleaned up"]
    assert get_run(conn, run_id)["status"] == "cancelled"
