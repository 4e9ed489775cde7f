"""Turns and flat claims (migration 0016): tenants with queued runs take turns within a priority
(a weight gives a larger share), a tenant back from idle waits at most one turn, the claim reads
only the kinds it may take, and the tenants' bookkeeping never drops a tenant whose run is being
enqueued while its last run is claimed. Plus a property test of the claim against a model of the
rules, over random queues of kinds, tenants, groups, priorities and pauses."""

from __future__ import annotations

from collections import Counter
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from leasework import operations
from leasework.errors import ConfigError
from leasework.leases import lease

from ..checks import KINDS, LEASE, claim_buffers, claim_one, make_app

Conn = psycopg.Connection[Any]


def drain_order(conn: Conn, kinds: list[str] | None = None) -> list[lease.Claim]:
    """Claim and seal one run at a time until nothing is claimed: the order of the claims."""
    order = []
    while (claim := claim_one(conn, kinds=kinds)) is not None:
        assert lease.finish(conn, claim, "succeeded")
        order.append(claim)
    return order


def test_a_small_tenant_waits_at_most_one_turn_behind_a_big_backlog(conn: Conn) -> None:
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(300)], tenant="big")
    first = claim_one(conn)
    assert first is not None and first.tenant == "big"
    assert lease.finish(conn, first, "succeeded")
    small = [app.enqueue(conn, "job", {}, tenant=f"small-{i}") for i in range(30)]

    order = [c.id for c in drain_order(conn)[:80]]

    # 31 tenants take turns: every small tenant's run within the first 31 claims, so `big`
    # (whose runs are all older) had at most one run between two small ones.
    assert set(small) <= set(order[:31])
    assert len(order) == 80


def test_weights_share_the_turns(conn: Conn) -> None:
    app = make_app()
    operations.set_tenant_weight(conn, "heavy", 3)
    app.enqueue_many(conn, "job", [{} for _ in range(60)], tenant="heavy")
    app.enqueue_many(conn, "job", [{} for _ in range(60)], tenant="light")

    first = drain_order(conn)[:40]

    heavy = sum(c.tenant == "heavy" for c in first)
    assert 28 <= heavy <= 32, heavy  # three turns to one: 30 of 40


def test_priority_comes_before_turns(conn: Conn) -> None:
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(5)], tenant="a")
    urgent = app.enqueue(conn, "job", {}, tenant="b", priority=-1)
    untenanted = app.enqueue(conn, "job", {}, priority=-2)

    order = [c.id for c in drain_order(conn)]

    assert order[:2] == [untenanted, urgent]
    assert len(order) == 7


def test_a_tenant_back_from_idle_gets_one_turn_not_a_burst(conn: Conn) -> None:
    app = make_app()
    app.enqueue(conn, "job", {}, tenant="back")
    drain_order(conn)
    app.enqueue_many(conn, "job", [{} for _ in range(40)], tenant="busy")
    drain = [claim_one(conn) for _ in range(20)]  # busy's turn runs 20 ahead
    for c in drain:
        assert c is not None and lease.finish(conn, c, "succeeded")
    app.enqueue_many(conn, "job", [{} for _ in range(10)], tenant="back")

    order = [c.tenant for c in drain_order(conn)][:10]

    # `back` starts at busy's turn, not at the turn it left with: the two alternate.
    assert order.count("back") in (5, 6), order


def test_runs_without_a_tenant_are_one_more_participant(conn: Conn) -> None:
    """A backlog of runs without a tenant, all older than the tenants' runs, takes one turn in
    two, not every claim until it is drained (runs without a tenant met the tenants' picks by
    queued_at: the 30 small tenants waited for all 300)."""
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(300)])
    first = claim_one(conn)
    assert first is not None and first.tenant is None
    assert lease.finish(conn, first, "succeeded")
    small = [app.enqueue(conn, "job", {}, tenant=f"small-{i}") for i in range(30)]

    order = drain_order(conn)[:80]

    # 31 participants take turns: every small tenant's run within the first 60 claims (one of
    # theirs, one without a tenant), and the runs without a tenant keep their share.
    assert set(small) <= {c.id for c in order[:60]}
    assert 29 <= sum(c.tenant is None for c in order[:60]) <= 31
    assert len(order) == 80


def test_a_weight_for_runs_without_a_tenant(conn: Conn) -> None:
    app = make_app()
    operations.set_tenant_weight(conn, None, 3)  # the runs without a tenant
    app.enqueue_many(conn, "job", [{} for _ in range(60)])
    app.enqueue_many(conn, "job", [{} for _ in range(60)], tenant="light")

    first = drain_order(conn)[:40]

    untenanted = sum(c.tenant is None for c in first)
    assert 28 <= untenanted <= 32, untenanted  # three turns to one: 30 of 40


def test_runs_without_a_tenant_back_from_idle_get_one_turn_not_a_burst(conn: Conn) -> None:
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(40)], tenant="busy")
    for _ in range(20):  # busy's turn runs 20 ahead, with nothing else queued
        c = claim_one(conn)
        assert c is not None and lease.finish(conn, c, "succeeded")
    app.enqueue_many(conn, "job", [{} for _ in range(10)])

    order = [c.tenant for c in drain_order(conn)][:10]

    # They start one of busy's turns behind it, not at the turn they left with: the two
    # alternate after that one turn.
    assert order.count(None) in (5, 6), order


def test_a_claim_never_waits_for_the_turn_of_runs_without_a_tenant(
    conn: Conn, other: Conn
) -> None:
    """While a rival claim holds their turn (here: another session's lock on it), a claim where
    tenants compete takes a tenant's run at once, and one where none does still takes runs
    without a tenant."""
    app = make_app()
    plain = app.enqueue(conn, "job", {})
    with other.transaction():
        other.execute("SELECT * FROM leasework.untenanted_turn FOR UPDATE")
        tenanted = app.enqueue(conn, "job", {}, tenant="t")
        conn.execute("SET lock_timeout = '2s'")  # a wait would fail the claim, not hang
        got = claim_one(conn)
        assert got is not None and got.id == tenanted
        again = claim_one(conn)  # t is held back by nothing, but has no run left: no contest
        assert again is not None and again.id == plain


def test_batch_claims_take_runs_without_a_tenant_up_to_the_last_tenants_turn(conn: Conn) -> None:
    """A tenant offers one pick per statement; runs without a tenant take their turns up to the
    last pick's, not the rest of the batch."""
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(50)])
    for t in ("a", "b", "c"):
        app.enqueue_many(conn, "job", [{} for _ in range(5)], tenant=t)

    got = lease.claim_runs(conn, KINDS, worker="w", lease=LEASE, limit=20)

    assert sorted(c.tenant or "" for c in got) == ["", "a", "b", "c"]
    alone = lease.claim_runs(conn, ["other"], worker="w", lease=LEASE, limit=20)
    assert alone == []  # (a kind with nothing queued)


def test_runs_without_a_tenant_keep_the_old_order_if_their_turn_row_is_gone(conn: Conn) -> None:
    app = make_app()
    old = app.enqueue(conn, "job", {})
    conn.execute("DELETE FROM leasework.untenanted_turn")
    new = app.enqueue(conn, "job", {}, tenant="t")

    assert [c.id for c in drain_order(conn)] == [old, new]


def test_the_tenants_bookkeeping_follows_the_queue(conn: Conn) -> None:
    app = make_app()
    app.enqueue(conn, "job", {}, tenant="t", priority=3)
    app.enqueue(conn, "job", {}, tenant="t", priority=1, delay=3600)

    def priority() -> int | None:
        row = conn.execute("SELECT priority FROM leasework.tenants WHERE name = 't'").fetchone()
        assert row is not None
        return row[0]  # type: ignore[no-any-return]

    assert priority() == 1
    claim = claim_one(conn)
    assert claim is not None and claim.tenant == "t"
    assert priority() == 1  # the delayed run is still queued
    conn.execute(
        "UPDATE leasework.runs SET status = 'cancelled', finished_at = now()"
        " WHERE status = 'queued'"
    )
    assert lease.requeue(conn, claim, delay=0, error="again") == "queued"
    assert priority() == 1  # a requeue marks the tenant again; cancelling does not clear it
    again = claim_one(conn)
    assert again is not None and again.id == claim.id
    assert priority() is None  # nothing queued left


def test_an_enqueue_in_flight_keeps_its_tenant_in_the_turns(conn: Conn, other: Conn) -> None:
    # The reproduction of the race the advisory lock closes: a claim takes a tenant's last queued
    # run while another session enqueues a run of that tenant in an open transaction. The claim
    # must not set the tenant's priority to NULL (nothing queued in its snapshot), or the new run,
    # once committed, would never be walked.
    app = make_app()
    app.enqueue(conn, "job", {}, tenant="t")
    with other.transaction():
        late = app.enqueue(other, "job", {}, tenant="t")
        claim = claim_one(conn)  # its snapshot cannot see `late`
        assert claim is not None and claim.id != late
    nxt = claim_one(conn, "w2")
    assert nxt is not None and nxt.id == late


def test_set_tenant_weight_refuses_a_bad_weight(conn: Conn) -> None:
    for bad in (0, -1, 1001, float("nan")):
        with pytest.raises(ConfigError, match=r"weight must be a number from 0\.001 to 1000"):
            operations.set_tenant_weight(conn, "t", bad)
    operations.set_tenant_weight(conn, "t", 2.5)
    assert [(r["name"], r["weight"]) for r in operations.tenants(conn)] == [("t", 2.5)]


def test_the_claim_reads_no_run_of_a_kind_it_may_not_take(conn: Conn) -> None:
    # 5,000 queued runs of a paused kind, of a kind another pool serves, of a tenant blocked by
    # its exclusive run and of a tenant whose group is full: the claim of the one other run reads
    # a handful of index pages, not thousands.
    conn.execute(
        "INSERT INTO leasework.runs (kind) SELECT 'paused' FROM generate_series(1, 5000);"
        "INSERT INTO leasework.runs (kind) SELECT 'elsewhere' FROM generate_series(1, 5000);"
        "INSERT INTO leasework.runs (kind, tenant, exclusive)"
        " SELECT 'job', 'blocked', true FROM generate_series(1, 5000);"
        'INSERT INTO leasework.runs (kind, tenant, "group")'
        " SELECT 'job', 'grouped', 'g' FROM generate_series(1, 5000);"
        "INSERT INTO leasework.paused_kinds (kind) VALUES ('paused');"
        "ANALYZE leasework.runs"
    )
    conn.execute(
        "INSERT INTO leasework.tenants (name) VALUES ('blocked'), ('grouped') ON CONFLICT DO NOTHING"
    )
    conn.execute(
        "UPDATE leasework.tenants SET priority = 0 WHERE name IN ('blocked', 'grouped');"
        "UPDATE leasework.runs SET status = 'running', attempts = 1, lease_owner = gen_random_uuid(),"
        " lease_expires_at = now() + interval '1 hour', started_at = now()"
        " WHERE id IN (SELECT min(id) FROM leasework.runs WHERE tenant IN ('blocked', 'grouped')"
        "               GROUP BY tenant)"
    )
    app = make_app()
    wanted = app.enqueue(conn, "other", {})
    buffers = claim_buffers(conn, ["job", "other", "paused"])
    assert buffers < 200, buffers
    row = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (wanted,)).fetchone()
    assert row is not None and row[0] == "running"


# -- the claim against a model of the rules -----------------------------------------------------

RUN = st.tuples(
    st.sampled_from(["job", "other", "paused"]),  # kind
    st.sampled_from([None, "t1", "t2", "t3"]),  # tenant
    st.sampled_from([None, "g1", "g2"]),  # group
    st.booleans(),  # exclusive
    st.sampled_from([0, 0, 1, -1]),  # priority
    st.sampled_from([0.0, 0.0, 0.0, 3600.0]),  # delay
)


def model_pick(
    conn: Conn, live: set[str], caps: dict[str, int] | None = None,
    group_limits: dict[str, int] | None = None, rate: tuple[int, str] | None = None,
) -> set[int]:
    """Every run the rules allow the next one-at-a-time claim to take, by the documented order:
    runs without a tenant by (priority, queued_at, id); tenants by (their best queued run's
    priority, turn, name), the first with a claimable run giving its best claimable run; the two
    compared by (priority, turn, queued_at, id), the turn of runs without a tenant being theirs
    (leasework.untenanted_turn) but never more than one of the tenant's turns behind its, and
    after it when past it. A run is claimable when due, of a live kind with a
    place under its cap (`caps`: max_running per kind), and, with a tenant, when no run of its
    tenant runs exclusively beside it and its tenant's group holds fewer runs than its kind's
    group_limit (`group_limits`; 1 when unset), and, of kind job with a `rate` (count, rate_per:
    "tenant" or "group"; the clock never moves here), when its budget has had fewer claims than
    the count: its tenant's, or per group its tenant's group's (its tenant's without a group);
    runs without a tenant share one."""
    caps, group_limits = caps or {}, group_limits or {}
    runs = conn.execute(
        'SELECT id, kind, tenant, "group", exclusive, priority, queued_at, status,'
        " status = 'queued' AND queued_at <= now() AS due, started_at IS NOT NULL"
        " FROM leasework.runs"
    ).fetchall()
    running = [r for r in runs if r[7] == "running"]

    def budget(r: tuple[Any, ...]) -> tuple[Any, Any] | None:
        if rate is None or r[2] is None:
            return None
        return (r[2], r[3] if rate[1] == "group" else None)

    used = Counter(budget(r) for r in runs if r[1] == "job" and r[9])

    def spent(r: tuple[Any, ...]) -> bool:
        return rate is not None and r[1] == "job" and used[budget(r)] >= rate[0]

    def blocked(r: tuple[Any, ...]) -> bool:
        mine = [o for o in running if o[2] == r[2]]
        if any(o[4] or r[4] for o in mine):
            return True
        same = sum(1 for o in mine if o[3] is not None and o[3] == r[3])
        return same >= group_limits.get(r[1], 1)

    def full(kind: str) -> bool:
        return kind in caps and sum(1 for o in running if o[1] == kind) >= caps[kind]

    claimable = [
        r
        for r in runs
        if r[8] and r[1] in live and not full(r[1]) and not (r[2] and blocked(r)) and not spent(r)
    ]
    key = lambda r: (r[5], r[6], r[0])  # noqa: E731
    untenanted = sorted((r for r in claimable if r[2] is None), key=key)
    tenants = conn.execute(
        "SELECT name, turn, weight FROM leasework.tenants WHERE priority IS NOT NULL"
    ).fetchall()
    best = {t: min(r[5] for r in runs if r[2] == t and r[7] == "queued") for t, *_ in tenants}
    pick = None
    for t, turn, weight in sorted(tenants, key=lambda x: (best[x[0]], x[1], x[0])):
        mine = sorted((r for r in claimable if r[2] == t), key=key)
        if mine:
            pick = (mine[0], turn, weight)
            break
    if pick is None:
        return {untenanted[0][0]} if untenanted else set()
    (p, p_turn, p_weight), candidates = pick, [(pick[0][5], pick[1], pick[0][6], pick[0][0])]
    if untenanted:
        u = untenanted[0]
        row = conn.execute("SELECT turn FROM leasework.untenanted_turn").fetchone()
        assert row is not None
        u_turn = max(row[0], p_turn - 1 / p_weight)  # back from idle: one turn behind at most
        if u[5] != p[5] or u_turn <= p_turn:  # past the pick's turn: after it, not now
            candidates.append((u[5], u_turn, u[6], u[0]))
    return {min(candidates)[3]}


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(RUN, min_size=1, max_size=20),
    st.integers(min_value=1, max_value=10),
    st.sampled_from([None, None, 1, 2]),  # job's max_running
    st.sampled_from([None, None, 2, 3]),  # job's group_limit
    st.sampled_from([(1.0, 1.0), (1.0, 1.0), (3.0, 1.0), (1.0, 0.5), (0.5, 2.0)]),  # weights
    # job's rate per hour (the clock never moves: a budget spent stays spent), per tenant or group
    st.sampled_from([None, None, (1, "group"), (2, "group"), (1, "tenant")]),
)
# A group wider than one, filled past its limit if the rule were off by one; a cap of 2 across
# tenants and runs without one.
@example([("job", "t1", "g1", False, 0, 0.0)] * 4, 8, None, 2, (1.0, 1.0), None)
@example(
    [("job", t, None, False, 0, 0.0) for t in (None, "t1", "t2", None, "t3")], 6, 2, None, (1.0, 1.0),
    None,
)
# A tenant whose first runs in order (more than the walk reads in order) wait for their full
# group: its next run is found group by group (leasework.tenant_group_pick), the best of an
# open group or of none, in order; a group of two the same.
@example(
    [("job", "t1", "g1", False, 0, 0.0)] * 6
    + [("job", "t1", "g2", False, 1, 0.0), ("job", "t1", "g2", False, 0, 0.0)]
    + [("job", "t1", None, False, 0, 0.0), ("job", "t2", "g1", False, 0, 0.0)],
    6, None, None, (1.0, 1.0), None,
)
@example(
    [("job", "t1", "g1", False, 0, 0.0)] * 7 + [("job", "t1", "g2", True, 0, 0.0)]
    + [("job", "t1", "g2", False, 0, 0.0)],
    5, None, 2, (1.0, 1.0), None,
)
# Runs without a tenant of weight 3 against t1 of weight 0.5, both with a backlog.
@example([("job", t, None, False, 0, 0.0) for t in [None, "t1"] * 5], 10, None, None, (3.0, 0.5),
         None)
# Rated 1 per group: t1's group g1 spends its budget on its first run, and the walk past its
# first four runs finds g2's and then the runs without a group, in order; t2's group g1 has a
# budget of its own. Rated 2 per tenant the same queue stops at two of t1's.
@example(
    [("job", "t1", "g1", False, 0, 0.0)] * 6
    + [("job", "t1", "g2", False, 0, 0.0), ("job", "t1", None, False, 0, 0.0)]
    + [("job", "t2", "g1", False, 0, 0.0), ("job", None, None, False, 0, 0.0)],
    8, None, 3, (1.0, 1.0), (1, "group"),
)
@example(
    [("job", "t1", "g1", False, 0, 0.0)] * 3 + [("job", "t1", "g2", False, 0, 0.0)] * 3,
    8, None, 3, (1.0, 1.0), (2, "tenant"),
)
# Rated 1 per group: exclusive runs of t1 behind five runs of g1 (its budget spent by the first),
# in g2, g3 and without a group, each taken once nothing of t1's runs (t2's runs keep the
# claims going meanwhile).
@example(
    [("job", "t1", "g1", False, 0, 0.0)] * 5
    + [("job", "t1", "g2", True, 0, 0.0), ("job", "t1", None, True, 0, 0.0)]
    + [("job", "t1", "g3", True, 0, 0.0)] + [("job", "t2", None, False, 0, 0.0)] * 4,
    10, None, None, (1.0, 1.0), (1, "group"),
)
def test_the_claim_takes_what_the_rules_allow_in_the_fair_order(
    conn: Conn,
    queue: list[tuple[Any, ...]],
    claims: int,
    max_running: int | None,
    group_limit: int | None,
    weights: tuple[float, float],
    rate: tuple[int, str] | None,
) -> None:
    conn.execute(
        "TRUNCATE leasework.runs, leasework.tenants, leasework.paused_kinds,"
        " leasework.kind_limits, leasework.rate_shards, leasework.tenant_rates,"
        " leasework.group_rates;"
        "INSERT INTO leasework.paused_kinds (kind) VALUES ('paused')"
    )
    # Runs without a tenant, and tenant t1, by these weights; every turn from 0.
    conn.execute("UPDATE leasework.untenanted_turn SET turn = 0, weight = %s", (weights[0],))
    operations.set_tenant_weight(conn, "t1", weights[1])
    if max_running or group_limit or rate:
        operations.set_limits(
            conn, "job", known=["job"], max_running=max_running, group_limit=group_limit,
            rate=f"{rate[0]}/1h" if rate else None, rate_per=rate[1] if rate else None,
        )
    caps = {"job": max_running} if max_running else {}
    group_limits = {"job": group_limit} if group_limit else {}
    app = make_app()
    for kind, tenant, group, exclusive, priority, delay in queue:
        app.enqueue(
            conn,
            kind if kind != "paused" else "job",
            {},
            tenant=tenant,
            group=group,
            exclusive=exclusive,
            priority=priority,
            delay=delay,
        )
        if kind == "paused":
            conn.execute(
                "UPDATE leasework.runs SET kind = 'paused' WHERE id = (SELECT max(id) FROM leasework.runs)"
            )
    live = set(KINDS)
    held: list[lease.Claim] = []
    for i in range(claims):
        allowed = model_pick(conn, live, caps, group_limits, rate)
        claim = claim_one(conn, f"w{i}", kinds=[*KINDS, "paused"])
        if not allowed:
            assert claim is None
            break
        assert claim is not None and claim.id in allowed
        held.append(claim)
        if i % 2:  # some claims end, others keep their lease (and hold back their tenant)
            assert lease.finish(conn, held.pop(0), "succeeded")
    # Never two conflicting live leases of one tenant, nor a group past its limit.
    rows = conn.execute(
        'SELECT tenant, "group", exclusive, kind FROM leasework.runs'
        " WHERE status = 'running' AND tenant IS NOT NULL"
    ).fetchall()
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            assert a[0] != b[0] or not (a[2] or b[2])
    for tenant, group in {(r[0], r[1]) for r in rows if r[1] is not None}:
        kinds = [r[3] for r in rows if (r[0], r[1]) == (tenant, group)]
        assert len(kinds) <= max(group_limits.get(k, 1) for k in kinds)
    if max_running:
        assert sum(1 for r in conn.execute("SELECT kind FROM leasework.runs WHERE"
                                           " status = 'running'").fetchall()
                   if r[0] == "job") <= max_running


def test_every_statement_that_queues_a_run_again_puts_its_tenant_back_in_the_turns(
    conn: Conn,
) -> None:
    # requeue_run (above), release_run, expire_and_promote's promotion and operations' retry
    # mark the tenant themselves (no row trigger on UPDATE): after each, the run is claimable.
    app = make_app()

    def priority(tenant: str) -> int | None:
        row = conn.execute("SELECT priority FROM leasework.tenants WHERE name = %s", (tenant,))
        got = row.fetchone()
        assert got is not None
        return got[0]  # type: ignore[no-any-return]

    released = app.enqueue(conn, "job", {}, tenant="rel", priority=2)
    claim = claim_one(conn)
    assert claim is not None and claim.id == released and priority("rel") is None
    assert lease.release(conn, claim) == "queued"
    assert priority("rel") == 2
    again = claim_one(conn)
    assert again is not None and again.id == released
    assert lease.finish(conn, again, "failed", error="boom")

    assert operations.retry(conn, ids=[released]).count == 1
    assert priority("rel") == 2
    assert claim_one(conn) is not None

    first = app.enqueue(conn, "job", {}, key="K", tenant="promo", exclusive=True)
    waiting = app.enqueue(conn, "job", {}, key="K", tenant="promo", exclusive=True)
    held = claim_one(conn)
    assert held is not None and held.id == first
    assert lease.finish(conn, held, "succeeded")
    assert priority("promo") is None
    assert lease.expire_and_promote(conn, 10)[1] == 1
    assert priority("promo") == 0
    promoted = claim_one(conn)
    assert promoted is not None and promoted.id == waiting


def test_a_queue_of_tenants_alone_never_locks_the_turn_of_runs_without_a_tenant(
    conn: Conn, other: Conn
) -> None:
    """Their turn is locked and written only while runs without a tenant are queued beside the
    tenants' picks: with none queued (a reclaim without a tenant included), a claim leaves it be."""
    app = make_app()
    expired = app.enqueue(conn, "job", {})
    got = claim_one(conn)
    assert got is not None and got.id == expired
    conn.execute(
        "UPDATE leasework.runs SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
        (expired,),
    )
    tenanted = [app.enqueue(conn, "job", {}, tenant=t) for t in ("a", "b")]
    with conn.transaction():
        taken = lease.claim_runs(conn, KINDS, worker="w", lease=LEASE, limit=5)
        assert sorted(c.id for c in taken) == sorted([expired, *tenanted])
        # Not locked by this claim's transaction: another session takes its lock at once.
        other.execute("SET lock_timeout = '1s'")
        with other.transaction():
            other.execute("SELECT * FROM leasework.untenanted_turn FOR UPDATE NOWAIT")
    row = conn.execute("SELECT turn FROM leasework.untenanted_turn").fetchone()
    assert row == (0.0,)
