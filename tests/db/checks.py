"""Invariant checks shared by the lease tests and the mutation check: each raises AssertionError
when the rule is broken, so test_mutations can show the suite catches a deliberately broken query.

The claim has two branches for every rule (tenanted runs, locked with their tenant row, and runs
without a tenant; lease.sql, claim_runs), each stating the same predicates again. So every check
of a claim rule takes `tenant` and runs once per branch (TENANTS)."""

from __future__ import annotations

import contextlib
import secrets
from typing import Any

import psycopg
import pytest

from leasework import App, Enqueued, operations
from leasework.leases import lease
from leasework.text import UNSAFE

from ..conftest import expire_lease, get_run, shift_clock, truncate_all, wait_for

Conn = psycopg.Connection[Any]
KINDS = ["job", "other"]
LEASE = 30.0
# Both branches of the claim: parametrize a check's `tenant` with these.
TENANTS = [pytest.param(None, id="untenanted"), pytest.param("ws-1", id="tenanted")]


def make_app() -> App:
    app = App()
    for kind in KINDS:
        app.task(kind)(lambda ctx, payload: None)
    return app


def claim_one(conn: Conn, worker: str = "w1", kinds: list[str] | None = None) -> lease.Claim | None:
    claims = lease.claim_runs(conn, kinds or KINDS, worker=worker, lease=LEASE, limit=1)
    assert len(claims) <= 1
    return claims[0] if claims else None


def stale_owner_writes_nothing(conn: Conn, tenant: str | None = None) -> None:
    """A live lease is not claimable; an expired one is reclaimed, and then the old owner's renew,
    control, checkpoint, finish, requeue, release and fence all match nothing and leave the row
    exactly as the new owner has it."""
    app = make_app()
    run_id = app.enqueue(conn, "job", {"n": 1}, tenant=tenant)
    old = claim_one(conn, "old")
    assert old is not None and old.id == run_id and old.attempts == 1
    assert old.tenant == tenant
    assert claim_one(conn, "thief") is None, "a live lease was claimed"
    expire_lease(conn, run_id)
    new = claim_one(conn, "new")
    assert new is not None and new.id == run_id, "an expired lease must be reclaimable"
    assert new.owner != old.owner and new.attempts == 2
    before = get_run(conn, run_id)
    assert before["lease_owner"] == new.owner and before["lease_worker"] == "new"

    assert lease.renew(conn, old) is None
    assert lease.control(conn, old) == "lost"
    assert lease.checkpoint(conn, old, 5, 10) is False
    assert lease.finish(conn, old, "succeeded", result={"stale": True}) is False
    assert lease.finish_many(conn, [(old, {"stale": True})]) == set()
    assert lease.requeue(conn, old, delay=0, error="stale") is None
    assert lease.snooze(conn, old, after=0, max_snoozes=100, reason="stale") is None
    assert lease.fail(conn, old, error="Fail: stale") is None
    assert lease.release(conn, old) is None
    with conn.transaction():
        assert lease.fence(conn, old) is False
    stored = lease.store_step(conn, old, "stale", lease.JsonText("1"))
    assert stored is False, "a stale owner stored a durable step"
    assert get_run(conn, run_id) == before, "a stale owner's write changed the row"
    steps = conn.execute("SELECT count(*) FROM leasework.run_steps").fetchone()
    assert steps == (0,), "a stale owner stored a durable step"

    # The new owner's writes land.
    assert lease.control(conn, new) == "ok"
    assert lease.renew(conn, new) is not None
    assert lease.checkpoint(conn, new, 1, 2) is True
    assert lease.store_step(conn, new, "fresh", lease.JsonText("2")) is True
    assert lease.load_steps(conn, new) == {"fresh": "2"}
    assert lease.finish(conn, new, "succeeded", result={"ok": 1}) is True
    done = get_run(conn, run_id)
    assert done["status"] == "succeeded" and done["result"] == {"ok": 1}
    assert [h["outcome"] for h in done["history"]] == ["expired", "succeeded"]


def cancel_beats_reclaim(conn: Conn, tenant: str | None = None) -> None:
    """A running run whose cancel was requested is never reclaimed once its lease expires; the
    poll's settle ends it `cancelled`."""
    app = make_app()
    run_id = app.enqueue(conn, "job", tenant=tenant)
    first = claim_one(conn, "w1")
    assert first is not None
    assert app.cancel(conn, run_id) == "running"
    assert lease.control(conn, first) == "cancelled"
    expire_lease(conn, run_id)
    assert claim_one(conn, "w2") is None, "a run with a cancel request was reclaimed"
    assert lease.expire_and_promote(conn, 100) == (1, 0)
    row = get_run(conn, run_id)
    assert row["status"] == "cancelled" and row["attempts"] == 1
    assert row["lease_owner"] is None and row["finished_at"] is not None


def last_attempt_is_never_reclaimed(conn: Conn, tenant: str | None = None) -> None:
    """An expired run with attempts left is reclaimed (and not settled); once it has used its
    last attempt it is never reclaimed, and the poll's settle ends it `failed`."""
    app = make_app()
    run_id = app.enqueue(conn, "job", tenant=tenant, max_attempts=2)
    first = claim_one(conn, "w1")
    assert first is not None and first.id == run_id and not first.last_attempt
    expire_lease(conn, run_id)
    assert lease.expire_and_promote(conn, 100) == (0, 0), "a run with attempts left was settled"
    assert get_run(conn, run_id)["status"] == "running"
    second = claim_one(conn, "w2")
    assert second is not None and second.id == run_id, "a run with attempts left was not reclaimed"
    assert second.attempts == 2 and second.last_attempt
    assert lease.expire_and_promote(conn, 100) == (0, 0)  # live lease: nothing to settle
    expire_lease(conn, run_id)
    assert claim_one(conn, "w3") is None, (
        "a run on its last attempt was reclaimed past max_attempts"
    )
    assert lease.expire_and_promote(conn, 100) == (1, 0)
    row = get_run(conn, run_id)
    assert row["status"] == "failed" and row["error"] == "lease expired"
    assert row["attempts"] == 2 and row["lease_owner"] is None and row["finished_at"] is not None
    assert [h["outcome"] for h in row["history"]] == ["expired", "expired"]
    assert lease.finish(conn, second, "succeeded") is False


def snooze_charges_no_attempt(conn: Conn, tenant: str | None = None) -> None:
    """A run on its only attempt snoozes (Snooze: snooze_run) and is claimed again on that same
    attempt once due, however often it snoozes: attempts stay as they were, so max_attempts is
    not used up; the snoozes are counted. Without the snoozes it would have ended `failed`."""
    app = make_app()
    run_id = app.enqueue(conn, "job", tenant=tenant, max_attempts=1)
    try:
        for n in range(1, 4):
            claim = claim_one(conn)
            assert claim is not None and claim.id == run_id
            assert claim.attempts == 1, f"snooze {n - 1} charged an attempt ({claim.attempts})"
            done = lease.snooze(conn, claim, after=60, max_snoozes=100, reason=f"nap {n}")
            assert done is not None and (done.status, done.snoozes) == ("queued", n), (
                f"a snooze on the run's only attempt ended it {done}"
            )
            row = get_run(conn, run_id)
            assert row["attempts"] == 0, f"snooze {n} charged an attempt ({row['attempts']})"
            assert claim_one(conn) is None, "a snoozed run was claimed before it was due"
            shift_clock(conn, 61 * n)
        last = claim_one(conn)
        assert last is not None and last.attempts == 1 and last.last_attempt
        assert lease.finish(conn, last, "succeeded", result={"ok": 1})
    finally:
        shift_clock(conn, 0)
    row = get_run(conn, run_id)
    assert row["status"] == "succeeded" and row["attempts"] == 1 and row["snoozes"] == 3
    assert [h["outcome"] for h in row["history"]] == ["snoozed"] * 3 + ["succeeded"]
    assert [h["attempt"] for h in row["history"]] == [1, 1, 1, 1]


def delayed_run_is_claimed_only_when_due(conn: Conn, tenant: str | None = None) -> None:
    """A run queued with queued_at in the future (enqueue's delay, a retry's backoff) is not
    claimed until it is due in database time, then is."""
    app = make_app()
    # Beside a due run: a delayed one of a better priority (read first in the claim's order)
    # and one of the same priority (read after it): only the due one is claimed.
    due = app.enqueue(conn, "job", tenant=tenant)
    app.enqueue(conn, "job", tenant=tenant, priority=-1, delay=60)
    app.enqueue(conn, "job", tenant=tenant, delay=60)
    claims = lease.claim_runs(conn, KINDS, worker="w", lease=LEASE, limit=3)
    assert [c.id for c in claims] == [due], "a delayed run was claimed before it was due"
    conn.execute("DELETE FROM leasework.runs")
    run_id = app.enqueue(conn, "job", tenant=tenant, delay=60)
    try:
        assert claim_one(conn) is None, "a delayed run was claimed before it was due"
        shift_clock(conn, 59)
        assert claim_one(conn) is None, "a delayed run was claimed before it was due"
        shift_clock(conn, 61)
        claim = claim_one(conn)
        assert claim is not None and claim.id == run_id, "a due run was not claimed"
        assert claim.tenant == tenant
    finally:
        shift_clock(conn, 0)


def drain(conn: Conn) -> list[int]:
    """Claim and seal one run at a time until nothing is claimed: the ids in claim order."""
    order = []
    while (claim := claim_one(conn)) is not None:
        assert lease.finish(conn, claim, "succeeded")
        order.append(claim.id)
    return order


def claim_order_is_priority_then_queued_at(conn: Conn, tenant: str | None = None) -> None:
    """The order rule: priority first, then (between tenants) turns, then queued_at. Runs of one
    tenant (or none) over two kinds come out by priority, then queued_at, whichever kind each is;
    an expired lease and a queued run of one tenant by priority, the older one waiting; and with
    a tenant, a tenant served more lately but holding an urgent run goes before one whose turn
    comes first."""
    app = make_app()
    late = app.enqueue(conn, "job", priority=0, tenant=tenant)
    urgent = app.enqueue(conn, "other", priority=-5, tenant=tenant)
    also_late = app.enqueue(conn, "job", priority=0, tenant=tenant)
    background = app.enqueue(conn, "other", priority=10, tenant=tenant)
    soon = app.enqueue(conn, "job", priority=-1, tenant=tenant)
    assert drain(conn) == [urgent, soon, late, also_late, background], (
        "runs of one tenant were not claimed by priority, then queued_at"
    )

    # A queued run of a better priority beats an older run whose lease expired.
    truncate_all(conn)
    stale = app.enqueue(conn, "job", priority=0, tenant=tenant)
    held = claim_one(conn, "gone")
    assert held is not None and held.id == stale
    expire_lease(conn, stale)
    better = app.enqueue(conn, "other", priority=-5, tenant=tenant)
    assert drain(conn) == [better, stale], (
        "an expired run was claimed before a queued run of a better priority"
    )
    if tenant is None:
        return

    # Two tenants: `served` had a turn lately (its turn is one ahead of `waiting`'s), then
    # queues an urgent run; `waiting` holds an ordinary run. Priority comes before turns.
    truncate_all(conn)
    served, waiting = f"{tenant}-served", f"{tenant}-waiting"
    app.enqueue(conn, "job", tenant=served)
    assert drain(conn) != []
    ordinary = app.enqueue(conn, "job", priority=0, tenant=waiting)
    pressing = app.enqueue(conn, "other", priority=-5, tenant=served)
    turns = dict(conn.execute("SELECT name, turn FROM leasework.tenants").fetchall())
    assert turns[waiting] < turns[served], turns  # else the walk's order is not tested
    assert drain(conn) == [pressing, ordinary], (
        "a tenant's urgent run waited for another tenant's turn: priority comes before turns"
    )


def claim_takes_only_its_kinds(conn: Conn, tenant: str | None = None) -> None:
    """A claim takes only runs of the kinds it asks for, queued or expired."""
    app = make_app()
    run_id = app.enqueue(conn, "other", tenant=tenant)
    assert claim_one(conn, "w1", kinds=["job"]) is None, "a claim took a queued run of another kind"
    # Behind a run of another kind, of the same priority and tenant: the claim takes its own.
    mine = app.enqueue(conn, "job", tenant=tenant)
    got = claim_one(conn, "w1", kinds=["job"])
    assert got is not None and got.id == mine, "a claim took a queued run of another kind"
    first = claim_one(conn, "w1", kinds=["other"])
    assert first is not None and first.id == run_id
    expire_lease(conn, run_id)
    assert claim_one(conn, "w2", kinds=["job"]) is None, (
        "a claim took an expired run of another kind"
    )
    again = claim_one(conn, "w2", kinds=["other"])
    assert again is not None and again.id == run_id and again.attempts == 2


def paused_kind_is_never_claimed(conn: Conn, tenant: str | None = None) -> None:
    """A paused kind is claimed by no one, queued or expired, batch claims included; the other
    kinds are claimed as ever, and a resumed kind is claimable again."""
    app = make_app()
    held = app.enqueue(conn, "job", tenant=tenant)
    first = claim_one(conn, "w1")
    assert first is not None and first.id == held
    queued = app.enqueue(conn, "job", tenant=f"{tenant}-2" if tenant else None)
    other = app.enqueue(conn, "other", tenant=f"{tenant}-3" if tenant else None)
    operations.pause(conn, ["job"])
    expire_lease(conn, held)
    claims = lease.claim_runs(conn, KINDS, worker="w2", lease=LEASE, limit=10)
    assert [c.id for c in claims if c.id == queued] == [], (
        "a claim took a queued run of a paused kind"
    )
    assert [c.id for c in claims if c.id == held] == [], (
        "a claim took an expired run of a paused kind"
    )
    assert [c.id for c in claims] == [other]
    operations.resume(conn, ["job"])
    again = lease.claim_runs(conn, KINDS, worker="w3", lease=LEASE, limit=10)
    assert sorted(c.id for c in again) == sorted([held, queued])


def capped_kind_takes_only_its_places(conn: Conn, tenant: str | None = None) -> None:
    """A kind capped at 2 (max_running): batch claims take only the places left, a reclaim
    included, whatever the tenants (one run per tenant per statement)."""
    truncate_all(conn)
    app = make_app()
    tenants = [f"{tenant}-{i}" if tenant else None for i in range(6)]
    ids = [app.enqueue(conn, "job", tenant=t) for t in tenants]
    operations.set_limits(conn, "job", known=KINDS, max_running=2)
    first = lease.claim_runs(conn, ["job"], worker="w1", lease=LEASE, limit=1)
    assert [c.id for c in first] == ids[:1]
    more = lease.claim_runs(conn, ["job"], worker="w2", lease=LEASE, limit=5)
    assert len(more) == 1, f"{1 + len(more)} runs of a kind capped at 2 were claimed"
    expire_lease(conn, ids[0])
    again = lease.claim_runs(conn, ["job"], worker="w3", lease=LEASE, limit=5)
    assert [c.id for c in again] == ids[:1], "a reclaim went past the cap"


def rated_kind_claims_only_its_rate(conn: Conn, tenant: str | None = None) -> None:
    """A kind rated 2 per 10 s: batch claims take two, then nothing until the window frees (a
    period and a slice on), whatever the tenants."""
    truncate_all(conn)
    shift_clock(conn, 0)
    app = make_app()
    tenants = [f"{tenant}-{i}" if tenant else None for i in range(6)]
    for t in tenants:
        app.enqueue(conn, "job", tenant=t)
    operations.set_limits(conn, "job", known=KINDS, rate="2/10s")
    got = []
    for i in range(4):
        got += lease.claim_runs(conn, ["job"], worker=f"w{i}", lease=LEASE, limit=5)
    assert len(got) == 2, f"{len(got)} claims of a kind rated 2 per 10 s within its period"
    shift_clock(conn, 10.6)
    again = []
    for i in range(4):
        again += lease.claim_runs(conn, ["job"], worker=f"v{i}", lease=LEASE, limit=5)
    assert len(again) == 2
    shift_clock(conn, 0)


def claim_buffers(conn: Conn, kinds: list[str]) -> int:
    """The shared buffers one claim_runs of `kinds` (one run) reads, by EXPLAIN (ANALYZE,
    BUFFERS): the claim is made (the run it takes is running after). A first EXPLAIN, rolled
    back, warms the session's plans (its first ones read the catalog)."""
    params = {"kinds": kinds, "worker": "w", "lease": LEASE, "limit": 1, "finishing": None}
    explain = b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + lease.Q["claim_runs"]
    with conn.transaction(force_rollback=True):
        conn.execute(explain, params)
    plan = conn.execute(explain, params).fetchone()
    assert plan is not None
    top = plan[0][0]["Plan"]
    return int(top["Shared Hit Blocks"] + top["Shared Read Blocks"])


def admit_holds_each_group_to_its_rate(conn: Conn) -> None:
    """leasework.admit for a kind rated 1 per 60 s per group, reading each window fresh: of two
    runs of one tenant's group in one call, one is admitted; its other group and its runs without
    a group have budgets of their own."""
    truncate_all(conn)
    app = make_app()
    a, b = (app.enqueue(conn, "job", {}, tenant="t1", group="g1") for _ in range(2))
    c = app.enqueue(conn, "job", {}, tenant="t1", group="g2")
    d = app.enqueue(conn, "job", {}, tenant="t1")
    operations.set_limits(
        conn, "job", known=KINDS, rate="1/60s", rate_per="group", group_limit=100
    )
    row = conn.execute(
        "SELECT leasework.admit(%s, ARRAY['job', 'job', 'job', 'job'],"
        " ARRAY['t1', 't1', 't1', 't1'], 4, NULL, 'w')",
        ([a, b, c, d],),
    ).fetchone()
    assert row == ([a, c, d],), f"admitted {row}: two runs of one group under a rate of 1 per 60 s"


def spent_group_budget_is_passed(conn: Conn) -> None:
    """A kind rated 1 per hour per group: a tenant's group g has spent its budget and has six
    runs queued ahead of the tenant's one run of group h (past the four the walk reads in order);
    the claim takes h's run."""
    truncate_all(conn)
    app = make_app()
    operations.set_limits(
        conn, "job", known=KINDS, rate="1/1h", rate_per="group", group_limit=100
    )
    app.enqueue(conn, "job", {}, tenant="t1", group="g")
    (first,) = lease.claim_runs(conn, ["job"], worker="w0", lease=LEASE)
    assert lease.finish(conn, first, "succeeded")
    for _ in range(6):
        app.enqueue(conn, "job", {}, tenant="t1", group="g")
    wanted = app.enqueue(conn, "job", {}, tenant="t1", group="h")
    got = [c.id for c in lease.claim_runs(conn, ["job"], worker="w1", lease=LEASE)]
    assert got == [wanted], f"claimed {got}, not the run of the group with a budget left"


def expire_worker_leases_expires_only_the_dead_workers_leases(
    conn: Conn, tenant: str | None = None
) -> None:
    """What expire_worker_leases writes: the dead worker's lease moved into the past (the run
    stays `running`, its attempt charged) and a `crashed` history entry; nothing of any other
    worker's run. The run is then claimable at once, and the crash is recorded once."""
    app = make_app()
    run_id = app.enqueue(conn, "job", tenant=tenant)
    untouched = app.enqueue(conn, "job", tenant=tenant)
    dead = claim_one(conn, "dead")
    alive = claim_one(conn, "alive")
    assert dead is not None and dead.id == run_id
    assert alive is not None and alive.id == untouched
    alive_before = get_run(conn, untouched)
    assert lease.expire_worker_leases(conn, "dead", "killed by signal 9") == [run_id]

    row = get_run(conn, run_id)
    assert row["lease_expires_at"] < lease.db_now(conn), "the dead worker's lease is not expired"
    assert row["status"] == "running" and row["attempts"] == 1
    assert row["lease_owner"] == dead.owner
    assert len(row["history"]) == 1, row["history"]
    entry = row["history"][0]
    assert entry["outcome"] == "crashed", f"the crash is not recorded as one: {entry}"
    assert entry["error"] == "killed by signal 9"
    assert (entry["attempt"], entry["worker"], entry["owner"]) == (1, "dead", str(dead.owner))
    assert get_run(conn, untouched) == alive_before, "another worker's run was touched"

    again = claim_one(conn, "w3")
    assert again is not None and again.id == run_id and again.attempts == 2
    history = get_run(conn, run_id)["history"]
    assert [h["outcome"] for h in history] == ["crashed"]  # recorded once, not twice
    assert lease.control(conn, alive) == "ok"


def settle_without_the_key_index(conn: Conn) -> tuple[int, int]:
    """What expire_and_promote itself decides while a waiting run's key is busy, in a transaction that
    drops the unique index of one active run per key (runs_one_active_per_key) and is then
    rolled back, index and all. With the index in place a wrong promotion fails as a unique
    violation: that shows the index held, not that settle's own rule did. Here a wrong promotion
    fails this helper's assertion. Returns settle's (ended, promoted), undone."""

    class Undo(Exception):
        pass

    outcome = (0, 0)
    with contextlib.suppress(Undo), conn.transaction():
        conn.execute("DROP INDEX leasework.runs_one_active_per_key")
        outcome = lease.expire_and_promote(conn, 100)
        # GROUP BY puts the runs without a tenant together: one namespace, as in the index.
        doubled = conn.execute(
            "SELECT tenant, key, array_agg(status ORDER BY id) FROM leasework.runs"
            " WHERE status IN ('queued', 'running') AND key IS NOT NULL"
            " GROUP BY tenant, key HAVING count(*) > 1"
        ).fetchall()
        assert not doubled, f"settle promoted a waiting run while its key was active: {doubled}"
        raise Undo
    return outcome


def waiting_run_waits_for_its_key(conn: Conn, tenant: str | None = None) -> None:
    """An exclusive run whose key is busy waits, is never claimed, and is promoted to `queued`
    by settle only once nothing else is active (queued or running) for its key in its tenant
    (`tenant`: None, the runs without one)."""
    app = make_app()
    sync = app.enqueue(conn, "job", key="conn-1", tenant=tenant)
    claim = claim_one(conn)
    assert claim is not None and claim.id == sync
    purge = app.enqueue(conn, "other", key="conn-1", tenant=tenant, exclusive=True)
    assert purge != sync and get_run(conn, purge)["status"] == "waiting"
    # one waiting per key, one active per key
    assert app.enqueue(conn, "other", key="conn-1", tenant=tenant, exclusive=True) == purge
    assert app.enqueue(conn, "job", key="conn-1", tenant=tenant) == sync

    assert settle_without_the_key_index(conn) == (0, 0), "promoted while its key was running"
    assert claim_one(conn, "w2") is None  # waiting is never claimed
    # Requeued (queued again) still holds the key.
    assert lease.requeue(conn, claim, delay=0, error="flaky") == "queued"
    assert settle_without_the_key_index(conn) == (0, 0), "promoted while its key was queued"
    again = claim_one(conn)
    assert again is not None and again.id == sync
    assert lease.finish(conn, again, "succeeded")

    assert lease.expire_and_promote(conn, 100) == (0, 1), "not promoted once its key was idle"
    assert get_run(conn, purge)["status"] == "queued"
    drained = claim_one(conn)
    assert drained is not None and drained.id == purge
    assert get_run(conn, purge)["exclusive"]


def waiting_run_waits_only_for_its_tenants_key(conn: Conn) -> None:
    """A key is its tenant's: another tenant's active run of the same key, or a run of it without
    a tenant, neither makes an exclusive run wait nor keeps a waiting one from its promotion."""
    app = make_app()
    mine = app.enqueue(conn, "job", key="k", tenant="b")
    claim = claim_one(conn)
    assert claim is not None and claim.id == mine
    waiting = app.enqueue(conn, "other", key="k", tenant="b", exclusive=True)
    assert get_run(conn, waiting)["status"] == "waiting"
    # Another tenant's, and an untenanted, exclusive run of "k": queued at once.
    for other in ("a", None):
        alone = app.enqueue(conn, "other", key="k", tenant=other, exclusive=True)
        assert get_run(conn, alone)["status"] == "queued", f"waited for tenant b's key ({other})"
    assert lease.finish(conn, claim, "succeeded")
    # Tenant a's and the untenanted run of "k" are still queued: b's key is idle all the same.
    assert lease.expire_and_promote(conn, 100) == (0, 1), (
        "a waiting run was not promoted while only other tenants' runs of its key were active"
    )
    assert get_run(conn, waiting)["status"] == "queued"


def promotion_skips_an_open_enqueue_of_its_tenants_key(
    conn: Conn, dsn: str, many: bool = False
) -> None:
    """The advisory lock an open enqueue holds is its tenant's and its key's (leasework.key_lock):
    the promotion of that tenant's waiting run of the key skips it, naming the session, instead of
    waiting on the uncommitted run (here: for lock_timeout, then fails), and a waiting run of the
    same key in another tenant is promoted meanwhile. `many`: the open enqueue is a keyed
    enqueue_many (which holds its keys' locks as leasework.enqueue does)."""
    app = make_app()
    for tenant in ("t", "u"):
        first = app.enqueue(conn, "job", key="K", tenant=tenant)
        claim = claim_one(conn)
        assert claim is not None and claim.id == first
        app.enqueue(conn, "other", key="K", tenant=tenant, exclusive=True)
        assert lease.finish(conn, claim, "succeeded")
    with psycopg.connect(dsn) as other:  # not autocommit: the enqueue stays open
        if many:
            app.enqueue_many(other, "job", [{}], keys=["K"], tenant="t")
        else:
            other.execute("SELECT leasework.enqueue('job', key => 'K', tenant => 't')")
        holder = other.info.backend_pid
        busy: list[int] = []
        try:
            with conn.transaction():
                conn.execute("SET LOCAL lock_timeout = '5s'")
                outcome = lease.expire_and_promote(conn, 100, busy)
        except psycopg.errors.LockNotAvailable:
            raise AssertionError(
                "the promotion waited on an open enqueue of its tenant's key"
            ) from None
        finally:
            other.rollback()
    assert outcome == (0, 1), "tenant u's waiting run was not promoted, or t's was"
    assert busy == [holder], "the session holding t's key was not named"
    promoted = conn.execute(
        "SELECT tenant FROM leasework.runs WHERE kind = 'other' AND status = 'queued'"
    ).fetchall()
    assert promoted == [("u",)]


def idle_fenced_transaction_is_ended(conn: Conn, dsn: str, deadline: float = 30.0) -> None:
    """A worker cut off inside its fenced transaction leaves its session idle in transaction,
    holding the run's row lock, which every claim skips. The server must end that session once
    it has been idle for the lease (fence_run sets idle_in_transaction_session_timeout), so the
    run is claimable again soon after the lease: not hours later, when TCP gives up on the dead
    peer. `deadline`: how long the run may stay unclaimable (the lease here is 1 s)."""
    app = make_app()
    run_id = app.enqueue(conn, "job")
    with psycopg.connect(dsn) as fenced:  # not autocommit: the fence opens the transaction
        claims = lease.claim_runs(conn, KINDS, worker="cut-off", lease=1.0, limit=1)
        assert [c.id for c in claims] == [run_id]
        assert lease.fence(fenced, claims[0])
        pid = fenced.info.backend_pid
        # ... and the worker goes silent with its transaction open.
        try:
            taken = wait_for(lambda: claim_one(conn, "w2"), timeout=deadline, interval=0.05)
        except AssertionError:
            raise AssertionError(
                f"run {run_id} still held by an idle fenced transaction after {deadline} s"
            ) from None
        assert taken.id == run_id and taken.attempts == 2

        def session_gone() -> bool:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,))
            return row.fetchone() == (0,)

        wait_for(session_gone, timeout=deadline)
        # The cut-off worker, back: its connection is gone (nothing it sends can commit).
        with contextlib.suppress(psycopg.Error):
            fenced.execute("SELECT 1")
        assert fenced.broken, "the idle fenced session still answers"


def sql_labels_refuse_every_unsafe_character(conn: Conn) -> None:
    """leasework.enqueue refuses a key, tenant or group holding any character of the label rule
    (leasework/text.py: C0 and C1 controls, DEL, bidi controls, line separators; not NUL, which
    Postgres text cannot hold), naming it, and writes nothing."""
    for code in sorted(UNSAFE - {0}):
        value = f"a{chr(code)}b"
        for label in ("key", "tenant", "group"):
            try:
                with conn.transaction():
                    conn.execute(f'SELECT leasework.enqueue(%s, "{label}" => %s)', ("job", value))
            except psycopg.errors.InvalidParameterValue as exc:
                said = f"{label} contains control characters (U+{code:04X};"
                assert str(exc).startswith(said), exc
            else:
                raise AssertionError(f"leasework.enqueue took {label} {value!r} (U+{code:04X})")
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (0,)


# -- unique windows and debounce (leasework.enqueue, migration 0022) -------------------------------

WINDOW = 3600.0  # seconds: the unique_for of the window checks


def _finish(conn: Conn, run_id: int, status: str = "succeeded") -> None:
    claims = lease.claim_runs(conn, KINDS, worker="w-window", lease=LEASE, limit=1)
    assert [c.id for c in claims] == [run_id], f"run {run_id} was not the one claimed: {claims}"
    assert lease.finish(conn, claims[0], status, error=None if status == "succeeded" else "x")


def unique_window_holds_finished_runs(conn: Conn, tenant: str | None = None) -> None:
    """An enqueue with unique_for returns the key's window run while it is queued, running and
    once it has succeeded, as long as it was enqueued less than unique_for ago; a run that failed
    holds no window; once the window is over the next enqueue makes a new run, which holds the
    next window. One connection, its own keys: it also runs in a transaction rolled back after
    (test_mutations' function mutants)."""
    app = make_app()
    key = f"report-{secrets.token_hex(4)}"

    def enqueue(n: int, unique_for: float = WINDOW) -> Enqueued:
        return app.enqueue_run(conn, "job", {"n": n}, key=key, tenant=tenant, unique_for=unique_for)

    try:
        first = enqueue(1)
        assert not first.existing
        assert enqueue(2) == Enqueued(first.run_id, True), "a queued window run was not returned"
        claim = lease.claim_runs(conn, KINDS, worker="w-window", lease=LEASE, limit=1)
        assert [c.id for c in claim] == [first.run_id]
        assert enqueue(3) == Enqueued(first.run_id, True), "a running window run was not returned"
        assert lease.finish(conn, claim[0], "succeeded")
        shift_clock(conn, WINDOW - 60)
        again = enqueue(4)
        assert again.run_id == first.run_id and again.how == "window", (
            "a run that succeeded inside its window did not hold it"
        )
        assert enqueue(5, unique_for=30).run_id != first.run_id, (
            "an enqueue with a shorter unique_for was held by an older window run"
        )
        # That enqueue took the window: its run is the key's window run now.
        second = get_run(conn, enqueue(6, unique_for=30).run_id)
        assert second["id"] != first.run_id and second["unique_at"] is not None
        assert get_run(conn, first.run_id)["unique_at"] is None, "two window runs of one key"
        _finish(conn, second["id"], "failed")
        third = enqueue(7)
        assert third.run_id not in (first.run_id, second["id"]) and not third.existing, (
            "a run that failed held its window"
        )
        shift_clock(conn, 2 * WINDOW)
        assert app.cancel(conn, third.run_id) == "cancelled"
        fourth = enqueue(8)
        assert not fourth.existing, "a cancelled run held its window"
        assert enqueue(9).run_id == fourth.run_id
        assert app.cancel(conn, fourth.run_id) == "cancelled"
    finally:
        shift_clock(conn, 0)


def merge_union(old: Any, new: Any) -> dict[str, list[int]]:
    """A debounce_merge that loses nothing: the union of both payloads' items."""
    return {"items": sorted(set(old.get("items", [])) | set(new.get("items", [])))}


def debounce_merge_keeps_a_racing_merge(conn: Conn) -> None:
    """A merge whose pending run took another enqueue's payload while it merged (here: the merge
    function itself enqueues first, as a racing process would) merges again rather than write
    over it: no item is lost. One connection (it also runs in a transaction rolled back after)."""
    app = make_app()
    key = f"doc-{secrets.token_hex(4)}"
    interloped: list[int] = []

    def merge(old: Any, new: Any) -> Any:
        if not interloped:
            interloped.append(1)
            app.enqueue(
                conn, "job", {"items": [99]}, key=key, debounce=60, debounce_merge=merge_union
            )
        return merge_union(old, new)

    first = app.enqueue(conn, "job", {"items": [1]}, key=key, debounce=60)
    again = app.enqueue_run(conn, "job", {"items": [2]}, key=key, debounce=60, debounce_merge=merge)
    assert again.run_id == first and again.how == "debounced"
    row = get_run(conn, first)
    assert row["payload"] == {"items": [1, 2, 99]}, (
        f"a racing merge's payload was lost: {row['payload']}"
    )
    assert row["debounce_count"] == 3
    assert app.cancel(conn, first) == "cancelled"
