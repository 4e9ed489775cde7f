"""Rate limits (migration 0023): at most `count` claims of a kind in any span of its period
(database time), a sliding window counted in twentieths of the period; per tenant with
rate_per="tenant" (runs without a tenant share one budget), a tenant's own rate set at run time;
batch claims and reclaims held to it too; a run over its rate stays queued, and an idle worker
sleeps until the window frees (next_due) rather than polling. Time moves by the database clock,
never by sleeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from leasework import App, operations, status
from leasework.errors import ConfigError
from leasework.leases import lease
from leasework.workers.worker import Worker

from ...conftest import expire_lease, shift_clock
from ..checks import KINDS, LEASE, claim_one, make_app

Conn = psycopg.Connection[Any]


def rate(conn: Conn, kind: str = "job", **limits: Any) -> None:
    operations.set_limits(conn, kind, known=KINDS, **limits)


def claim_all(conn: Conn, worker: str = "w", limit: int = 10, kinds: list[str] | None = None) -> list[int]:
    return [
        c.id for c in lease.claim_runs(conn, kinds or KINDS, worker=worker, lease=LEASE, limit=limit)
    ]


def test_a_rate_admits_its_count_per_period_then_waits(conn: Conn) -> None:
    app = make_app()
    ids = app.enqueue_many(conn, "job", [{} for _ in range(8)])
    rate(conn, rate="3/10s")
    assert claim_all(conn, "w1", limit=5) == ids[:3], "a batch claim went past the rate"
    assert claim_all(conn, "w2") == []
    assert lease.next_due(conn, ["job"]) is not None
    shift_clock(conn, 9.9)  # within the period: still full, whatever was sealed meanwhile
    assert claim_all(conn, "w3") == []
    shift_clock(conn, 10.6)  # a period and a slice on: the three claims no longer count
    assert claim_all(conn, "w4", limit=5) == ids[3:6]


def test_the_window_slides(conn: Conn) -> None:
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(8)])
    rate(conn, rate="3/10s")
    assert len(claim_all(conn, limit=2)) == 2
    shift_clock(conn, 5)
    assert len(claim_all(conn, limit=2)) == 1  # three within 10 s
    shift_clock(conn, 10.6)
    # The two of t0 are out of the window, the one of t0 + 5 s is not: two more, not three.
    assert len(claim_all(conn, limit=5)) == 2
    shift_clock(conn, 15.6)
    assert len(claim_all(conn, limit=5)) == 1


def test_a_rate_per_tenant_gives_each_tenant_its_budget(conn: Conn) -> None:
    app = make_app()
    t1 = [app.enqueue(conn, "job", {}, tenant="t1") for _ in range(3)]
    t2 = [app.enqueue(conn, "job", {}, tenant="t2") for _ in range(2)]
    loose = [app.enqueue(conn, "job", {}) for _ in range(3)]
    rate(conn, rate="2/60s", rate_per="tenant")
    got = set()
    for i in range(10):
        got |= set(claim_all(conn, f"w{i}", limit=3))
    # Each tenant two, the runs without a tenant two between them (one budget).
    assert got == {*t1[:2], *t2, *loose[:2]}
    # An operator gives t1 a rate of its own.
    operations.set_tenant_rate(conn, "job", "t1", "3/60s")
    assert claim_all(conn, "w", limit=5) == [t1[2]]
    assert claim_all(conn, "w") == []
    operations.set_tenant_rate(conn, "job", "t1", None)  # back to the kind's
    rows = status.limits(conn)
    assert rows[0]["tenant_rates"] == []


def test_a_tenant_at_its_rate_still_gets_its_other_kinds_runs(conn: Conn) -> None:
    app = make_app()
    rate(conn, rate="1/60s", rate_per="tenant")
    app.enqueue(conn, "job", {}, tenant="t1")
    app.enqueue(conn, "job", {}, tenant="t1")
    other = app.enqueue(conn, "other", {}, tenant="t1")
    first = claim_one(conn, "w1")
    assert first is not None and first.kind == "job"
    assert lease.finish(conn, first, "succeeded")
    nxt = claim_one(conn, "w2")
    assert nxt is not None and nxt.id == other


def test_a_reclaim_counts_against_the_rate(conn: Conn) -> None:
    app = make_app()
    crashed = app.enqueue(conn, "job", {})
    rate(conn, rate="1/60s")
    assert claim_one(conn, "dead") is not None
    expire_lease(conn, crashed)
    assert claim_one(conn, "w2") is None, "a reclaim went past the rate"
    shift_clock(conn, 63.1)  # a period and a slice (3 s) on
    again = claim_one(conn, "w2")
    assert again is not None and again.id == crashed and again.attempts == 2


def test_a_rate_set_at_run_time_wins_until_reset(conn: Conn) -> None:
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(6)])
    operations.declare_limits(conn, {"job": {"rate": [1, 60.0]}})
    assert len(claim_all(conn, limit=3)) == 1
    rate(conn, rate="3/60s")  # counts the claims made under the declared rate
    assert len(claim_all(conn, limit=3)) == 2
    rate(conn, rate=None)
    assert len(claim_all(conn, limit=2)) == 2
    operations.reset_limits(conn, "job", ["rate"])
    assert claim_all(conn) == []


def test_a_tenants_rate_needs_a_rate_per_tenant(conn: Conn) -> None:
    make_app().enqueue(conn, "job", {}, tenant="t1")
    with pytest.raises(ConfigError, match="job has no rate per tenant"):
        operations.set_tenant_rate(conn, "job", "t1", "1/s")
    rate(conn, rate="1/s", rate_per="tenant")
    with pytest.raises(ConfigError, match="is not valid: write COUNT/PERIOD"):
        operations.set_tenant_rate(conn, "job", "t1", "fast")
    with pytest.raises(ConfigError, match="would have no rate"):
        operations.reset_limits(conn, "job", ["rate"])


def test_rates_are_parsed_as_written(conn: Conn) -> None:
    assert operations.parse_rate("100/10s") == (100, 10.0)
    assert operations.parse_rate("5/m") == (5, 60.0)
    assert operations.parse_rate(" 1000 / 1h ") == (1000, 3600.0)
    assert operations.parse_rate("10/500ms") == (10, 0.5)
    assert status.rate_spec(100, 10.0) == "100/10s"
    assert status.rate_spec(5, 60.0) == "5/1m"
    assert status.rate_spec(7, 86400.0) == "7/1d"


# -- idle workers sleep until the window frees -------------------------------------------------

MakeWorker = Callable[..., Worker]


def test_an_idle_worker_sleeps_until_the_window_frees(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    done: list[int] = []

    @app.task("metered", rate="1/60s")
    def metered(ctx: Any, payload: Any) -> None:
        done.append(ctx.run_id)

    first = app.enqueue(conn, "metered", {})
    later = app.enqueue(conn, "metered", {})
    worker = make_worker(app, poll_interval=0.05, idle_poll_max=600.0)
    assert worker.poll() >= 1  # declares the rate, claims and runs the first run
    assert done == [first]
    # Every due run is rate-limited: the poll claims nothing, and the worker may sleep until
    # the window has room again (a period and at most a slice, 3 s, after the first claim), not
    # poll_interval.
    assert worker.poll() == 0
    due = worker.idle_timeout(time.monotonic())
    assert 55.0 < due <= 63.0, due
    assert lease.next_due(conn, ["metered"]) == pytest.approx(due, abs=1.5)
    row = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (later,)).fetchone()
    assert row == ("queued",)
    # Removing the rate at run time wakes idle workers (NOTIFY) and the run goes.
    operations.set_limits(conn, "metered", known=["metered"], rate=None)
    assert worker.poll() >= 1
    assert done == [first, later]


def test_admit_holds_each_tenant_to_its_window(conn: Conn) -> None:
    # leasework.admit itself, with a fresh read of the tenant's window (the walk's check is a hint
    # in the statement's snapshot): two runs of t1 in one call, one admitted.
    app = make_app()
    a, b = (app.enqueue(conn, "job", {}, tenant="t1") for _ in range(2))
    c = app.enqueue(conn, "job", {}, tenant="t2")
    rate(conn, rate="1/60s", rate_per="tenant")
    row = conn.execute(
        "SELECT leasework.admit(%s, ARRAY['job', 'job', 'job'], ARRAY['t1', 't1', 't2'], 3,"
        " NULL, 'w')",
        ([a, b, c],),
    ).fetchone()
    assert row == ([a, c],)


def test_maintenance_prunes_the_windows_that_count_nothing(conn: Conn) -> None:
    from leasework.config import Config
    from leasework.stages.maintenance import prune_rate_windows

    app = make_app()
    for tenant in ("t1", "t2", "t3"):
        app.enqueue(conn, "job", {}, tenant=tenant)
    rate(conn, rate="1/10s", rate_per="tenant")
    for i in range(3):
        claim_all(conn, f"w{i}")
    operations.set_tenant_rate(conn, "job", "t3", "5/10s")  # a rate of its own: kept

    def rows() -> list[str]:
        return [r[0] for r in conn.execute("SELECT tenant FROM leasework.tenant_rates ORDER BY 1")]

    assert rows() == ["t1", "t2", "t3"]
    assert prune_rate_windows(conn, Config(), 100) == 0  # every window still counts its claim
    shift_clock(conn, 10.6)
    assert prune_rate_windows(conn, Config(), 1) == 1  # bounded
    assert prune_rate_windows(conn, Config(), 100) == 1
    assert rows() == ["t3"]


def test_a_window_of_the_wrong_shape_is_refused(conn: Conn) -> None:
    # Whoever writes it (the worker role can): no reader's arithmetic may overflow on it.
    rate(conn, rate="1/10s")  # its one shard
    good = conn.execute("SELECT leasework.rate_recorded(NULL, 10, now(), 1)").fetchone()
    assert good is not None
    conn.execute("UPDATE leasework.rate_shards SET win = %s, carried = %s", (good[0], good[0]))
    for bad in (
        [1, 2],
        [0, *good[0][1:]],
        [good[0][0], good[0][1], -1, *good[0][3:]],
        [good[0][0], 2**62, *good[0][2:]],
    ):
        for column in ("win", "carried"):
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute(f"UPDATE leasework.rate_shards SET {column} = %s", (bad,))


def rated_quick(conn: Conn, sealing: lease.Claim, one: bool, probed: bool = True) -> list[int]:
    """finish_and_claim_rated for `sealing` (committed): the id of the run it claimed, if any."""
    if one:
        text = lease.FINISH_AND_CLAIM_RATED_ONE if probed else lease.FINISH_AND_CLAIM_RATED_LEAN_ONE
    else:
        text = lease.FINISH_AND_CLAIM_RATED if probed else lease.FINISH_AND_CLAIM_RATED_LEAN
    params = {
        "id": sealing.id,
        "owner": sealing.owner,
        "result": None,
        "kinds": ["job"] if one else KINDS,
        "worker": "w1",
        "lease": LEASE,
    }
    with conn.transaction():
        rows = conn.execute(text, params).fetchall()
    return [r[1] for r in rows if not r[0]]


def window_count(conn: Conn) -> int:
    """The claims the kind's window counts now: every shard's (leasework.rate_shards)."""
    row = conn.execute(
        "SELECT leasework.rate_used(leasework.rate_shards_window(l.kind, l.rate_seconds),"
        "                           l.rate_seconds, leasework.now())"
        " FROM leasework.kind_limits l WHERE kind = 'job'"
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("one", [True, False], ids=["one-kind", "several-kinds"])
@pytest.mark.parametrize("probed", [True, False], ids=["probed", "lean"])
def test_the_rated_quick_claim_records_each_claim_and_stops_at_the_rate(
    conn: Conn, one: bool, probed: bool
) -> None:
    # The quick statement's rated form claims a rated kind's run itself, recording the claim in
    # the kind's window in the same statement; at the rate it claims nothing and records nothing.
    app = make_app()
    ids = app.enqueue_many(conn, "job", [{} for _ in range(6)])
    rate(conn, rate="3/10s", max_running=5)
    first = claim_one(conn, "w1", ["job"])
    assert first is not None and first.id == ids[0] and window_count(conn) == 1
    got = rated_quick(conn, first, one, probed)
    assert got == [ids[1]] and window_count(conn) == 2
    second = lease.claim_runs(conn, ["job"], worker="w2", lease=LEASE)  # the third claim
    assert [c.id for c in second] == [ids[2]] and window_count(conn) == 3
    nxt = claim_one(conn, "w3", ["job"])
    assert nxt is None
    sealing = second[0]
    assert rated_quick(conn, sealing, one, probed) == [], "the rated claim went past the rate"
    assert window_count(conn) == 3
    shift_clock(conn, 10.6)  # the window frees
    again = claim_one(conn, "w4", ["job"])
    assert again is not None and window_count(conn) == 1


def test_a_chain_learns_that_a_kind_is_rated_and_claims_it_with_the_quick_statement(
    conn: Conn,
) -> None:
    app = make_app()
    ids = app.enqueue_many(conn, "job", [{} for _ in range(5)])
    rate(conn, rate="1000/1s")
    chain = lease.Chain(recheck=0.0)
    first = claim_one(conn, "w1", ["job"])
    assert first is not None and not chain.rated
    sealed, run = lease.finish_and_claim(conn, first, ["job"], worker="w1", lease=LEASE, chain=chain)
    # The plain quick statement leaves a rated kind out; claim_runs took it, and the chain asked.
    assert sealed and run is not None and run.id == ids[1] and chain.rated
    for expected in ids[2:]:
        assert run is not None
        fell_back_at = chain.whole_until
        sealed, run = lease.finish_and_claim(conn, run, ["job"], worker="w1", lease=LEASE, chain=chain)
        assert sealed and run is not None and run.id == expected
        assert chain.whole_until == fell_back_at, "the rated quick statement claimed nothing"
    assert window_count(conn) == 5


def test_a_chain_that_learns_a_kind_is_rated_sends_the_quick_statement_at_once(
    conn: Conn,
) -> None:
    # A worker's Chain holds the whole statement for `recheck` (its poll_interval) after the
    # quick one claimed nothing; when that was only because the plain quick statement leaves a
    # rated kind out, the rated form claims the next run at once.
    app = make_app()
    ids = app.enqueue_many(conn, "job", [{} for _ in range(4)])
    rate(conn, rate="1000/1s")
    chain = lease.Chain(recheck=60.0)
    first = claim_one(conn, "w1", ["job"])
    assert first is not None
    sealed, run = lease.finish_and_claim(conn, first, ["job"], worker="w1", lease=LEASE, chain=chain)
    assert sealed and run is not None and run.id == ids[1] and chain.rated
    assert chain.quick(time.monotonic()), "the whole statement is held for recheck seconds"
    sealed, run = lease.finish_and_claim(conn, run, ["job"], worker="w1", lease=LEASE, chain=chain)
    assert sealed and run is not None and run.id == ids[2]
    assert chain.quick(time.monotonic()), "the rated quick statement claimed nothing"
