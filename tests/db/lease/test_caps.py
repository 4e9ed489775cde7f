"""Concurrency caps (migration 0023): at most `max_running` runs of a kind hold a live lease across
every claimer, a batch claim takes only the places left, a crashed run's place frees when its
lease expires, the run sealed with a claim does not hold a place, the quick claims hand the sealed
run's place on to the next run of its kind and take no other capped kind's run; a tenant's group runs up to its kind's `group_limit` at once, an exclusive run
still alone; an operator's value wins over the declared one until reset."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from leasework import operations, status
from leasework.errors import ConfigError, NotFound
from leasework.leases import lease

from ...conftest import expire_lease, shift_clock, wait_for
from ..checks import KINDS, LEASE, claim_one, make_app

Conn = psycopg.Connection[Any]

LIVE_OF_KIND = """
SELECT count(*) FROM leasework.runs
 WHERE kind = %s AND status = 'running' AND lease_expires_at >= leasework.now()
"""


def live(conn: Conn, kind: str = "job") -> int:
    row = conn.execute(LIVE_OF_KIND, (kind,)).fetchone()
    assert row is not None
    return int(row[0])


def cap(conn: Conn, kind: str = "job", **limits: Any) -> None:
    operations.set_limits(conn, kind, known=KINDS, **limits)


def test_max_running_caps_the_kind_across_claimers(conn: Conn) -> None:
    app = make_app()
    ids = app.enqueue_many(conn, "job", [{} for _ in range(5)])
    other = app.enqueue(conn, "other", {})
    cap(conn, max_running=2)
    a, b = claim_one(conn, "w1"), claim_one(conn, "w2")
    assert a is not None and b is not None and [a.id, b.id] == ids[:2]
    # The cap is full: the next claims take the kind nobody capped, then nothing.
    c = claim_one(conn, "w3")
    assert c is not None and c.id == other
    assert claim_one(conn, "w4") is None, "a third run of a kind capped at 2 was claimed"
    assert live(conn) == 2
    assert lease.finish(conn, a, "succeeded")
    d = claim_one(conn, "w4")
    assert d is not None and d.id == ids[2]
    assert live(conn) == 2


def test_a_batch_claim_takes_only_the_places_left(conn: Conn) -> None:
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(10)])
    cap(conn, max_running=3)
    first = lease.claim_runs(conn, ["job"], worker="w1", lease=LEASE, limit=2)
    assert len(first) == 2
    more = lease.claim_runs(conn, ["job"], worker="w2", lease=LEASE, limit=5)
    assert len(more) == 1, "a batch claim took more than the places left"
    assert lease.claim_runs(conn, ["job"], worker="w3", lease=LEASE, limit=5) == []
    assert live(conn) == 3


def test_a_crashed_runs_place_frees_when_its_lease_expires(conn: Conn) -> None:
    app = make_app()
    crashed = app.enqueue(conn, "job", {})
    waiting = app.enqueue(conn, "job", {})
    cap(conn, max_running=1)
    held = claim_one(conn, "dead")
    assert held is not None and held.id == crashed
    assert claim_one(conn, "w2") is None
    expire_lease(conn, crashed)  # its worker died: only a live lease holds a place
    again = claim_one(conn, "w2")
    # The reclaim goes through the cap too: the expired run (older) is taken, alone.
    assert again is not None and again.id == crashed and again.attempts == 2
    assert claim_one(conn, "w3") is None
    assert lease.finish(conn, again, "succeeded")
    last = claim_one(conn, "w3")
    assert last is not None and last.id == waiting


def test_the_run_sealed_with_the_claim_does_not_hold_a_place(conn: Conn) -> None:
    app = make_app()
    ids = app.enqueue_many(conn, "job", [{} for _ in range(3)])
    cap(conn, max_running=1)
    first = claim_one(conn, "w1")
    assert first is not None
    sealed, nxt = lease.finish_and_claim(conn, first, ["job"], worker="w1", lease=LEASE)
    assert sealed and nxt is not None and nxt.id == ids[1]
    # Another worker's seal does not free this worker's place: its run still holds it.
    assert claim_one(conn, "w2") is None
    # With a Chain, the quick statement takes no capped kind's run; claim_runs does.
    chain = lease.Chain()
    sealed, last = lease.finish_and_claim(
        conn, nxt, ["job"], worker="w1", lease=LEASE, chain=chain
    )
    assert sealed and last is not None and last.id == ids[2]
    assert live(conn) == 1


def test_a_worker_that_lost_its_lease_does_not_free_the_new_owners_place(conn: Conn) -> None:
    app = make_app()
    run = app.enqueue(conn, "job", {})
    app.enqueue(conn, "job", {})
    cap(conn, max_running=1)
    old = claim_one(conn, "old")
    assert old is not None
    expire_lease(conn, run)
    new = claim_one(conn, "new")
    assert new is not None and new.id == run
    # The old owner's seal matches nothing, and its claim counts the new owner's lease.
    sealed, nxt = lease.finish_and_claim(conn, old, ["job"], worker="old", lease=LEASE)
    assert not sealed and nxt is None
    assert live(conn) == 1


def quick_claim(conn: Conn, sealing: lease.Claim, kinds: list[str], one: bool) -> list[Any]:
    """finish_and_claim_queued (probed; the form for one kind or for several) for `sealing`,
    rolled back: its rows' (sealed, id), the sealed run's first."""
    text = lease.FINISH_AND_CLAIM_QUEUED_ONE if one else lease.FINISH_AND_CLAIM_QUEUED
    params = {
        "id": sealing.id,
        "owner": sealing.owner,
        "result": None,
        "kinds": kinds,
        "worker": "w1",
        "lease": LEASE,
    }
    with conn.transaction(force_rollback=True):
        rows = conn.execute(text, params).fetchall()
    return sorted(((r[0], r[1]) for r in rows), reverse=True)


FORMS = [pytest.param(True, id="one-kind"), pytest.param(False, id="several-kinds")]


@pytest.mark.parametrize("one", FORMS)
def test_the_quick_claims_hand_the_sealed_runs_place_on_to_the_next_run_of_its_kind(
    conn: Conn, one: bool
) -> None:
    # Seal and claim in one commit: the kind's live leases are as many after as before, so the
    # quick statement takes the next run of a capped kind without the kind's row or a fresh count.
    app = make_app()
    ids = app.enqueue_many(conn, "job", [{} for _ in range(3)])
    cap(conn, max_running=1)
    first = claim_one(conn, "w1", ["job"])
    assert first is not None and first.id == ids[0]
    kinds = ["job"] if one else KINDS
    assert quick_claim(conn, first, kinds, one) == [(True, ids[0]), (False, ids[1])]
    # Through a Chain, as a worker drains it: each run sealed hands its place on.
    chain, run = lease.Chain(), first
    for expected in ids[1:]:
        sealed, nxt = lease.finish_and_claim(conn, run, kinds, worker="w1", lease=LEASE, chain=chain)
        assert sealed and nxt is not None and nxt.id == expected
        assert chain.quick(float("inf")) and chain.whole_until == float("-inf"), (
            "the quick statement claimed nothing: claim_runs took the run"
        )
        assert live(conn) == 1
        run = nxt


@pytest.mark.parametrize("one", FORMS)
def test_the_quick_claims_hand_on_no_place_they_do_not_hold(conn: Conn, one: bool) -> None:
    # No hand-on (the quick claim takes nothing; claim_runs admits or not) when the kind has a
    # rate too (each claim must be recorded in its window), when the sealed run is of another
    # kind, when the sealed run is no longer ours, or when the kind holds more live leases than
    # its cap (lowered since).
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(4)])
    kinds = ["job"] if one else KINDS
    first = claim_one(conn, "w1", ["job"])
    assert first is not None

    cap(conn, max_running=5, rate="1000/1s")
    assert quick_claim(conn, first, kinds, one) == [(True, first.id)], "a rated kind's run"
    cap(conn, max_running=5, rate=None)

    other_id = app.enqueue(conn, "other", {})
    other = claim_one(conn, "w2", ["other"])
    assert other is not None and other.id == other_id
    if not one:
        assert [r[0] for r in quick_claim(conn, other, kinds, one)] == [True], (
            "a capped kind's run took the place of another kind's run"
        )

    second = claim_one(conn, "w3", ["job"])
    assert second is not None
    cap(conn, max_running=1)  # two live leases now: over the cap
    assert quick_claim(conn, first, kinds, one) == [(True, first.id)], "a place over the cap"
    cap(conn, max_running=2)
    assert [r[0] for r in quick_claim(conn, first, kinds, one)] == [True, False]

    expire_lease(conn, first.id)
    again = claim_one(conn, "w4", ["job"])
    assert again is not None and again.id == first.id  # reclaimed: no longer w1's
    assert quick_claim(conn, first, kinds, one) == [], "a lost lease's place handed on"


def test_a_hand_on_never_waits_on_the_kinds_row_nor_passes_a_lowered_cap(conn: Conn, dsn: str) -> None:
    # A rival holds the kind's row (an operator lowering the cap): the hand-on does not wait
    # on it. Once the cap below the live leases commits, no hand-on.
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(4)])
    cap(conn, max_running=2)
    first = claim_one(conn, "w1", ["job"])
    second = claim_one(conn, "w2", ["job"])
    assert first is not None and second is not None
    with psycopg.connect(dsn) as rival:
        rival.execute(
            "SELECT 1 FROM leasework.kind_limits WHERE kind = 'job' FOR UPDATE"
        )  # held until the block ends
        conn.execute("SET lock_timeout = '2s'")
        try:
            assert [r[0] for r in quick_claim(conn, first, ["job"], True)] == [True, False]
        finally:
            conn.execute("RESET lock_timeout")
        cap(rival, max_running=1)
    assert quick_claim(conn, first, ["job"], True) == [(True, first.id)]


def test_no_hand_on_of_a_lease_that_expired(conn: Conn) -> None:
    # Expired, its place is free to any claim that admits: the sealed run's worker may not hand
    # it on, even before anyone reclaimed the run.
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(3)])
    cap(conn, max_running=1)
    first = claim_one(conn, "w1", ["job"])
    assert first is not None
    expire_lease(conn, first.id)
    assert [r[0] for r in quick_claim(conn, first, ["job"], True)] == [True]


def test_an_admit_counts_the_places_handed_on_while_it_waited(conn: Conn, dsn: str) -> None:
    # A hand-on sees the sealed run's lease live; a claim that admits, its clock past that lease
    # (time went on while the hand-on was in flight), would count the place as free. It waits for the hand-on in flight (the kind's cap
    # lock) and then counts the run handed the place: nothing past the cap.
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(5)])
    cap(conn, max_running=2)
    first = claim_one(conn, "w1", ["job"])
    other = claim_one(conn, "w2", ["job"])
    assert first is not None and other is not None
    params = {
        "id": first.id,
        "owner": first.owner,
        "result": None,
        "kinds": ["job"],
        "worker": "w1",
        "lease": 600.0,  # the run handed the place holds it past the rival's clock
    }
    got: list[list[int]] = []
    # The first run's lease ends in a minute; the rival's clock is two minutes on: there it has
    # expired, while every lease given now (30 s) is still live.
    conn.execute(
        "UPDATE leasework.runs SET lease_expires_at = leasework.now() + interval '60 seconds'"
        " WHERE id = %s",
        (first.id,),
    )
    with psycopg.connect(dsn, autocommit=True) as rival:
        shift_clock(rival, 120)
        conn.execute(
            "UPDATE leasework.runs SET lease_expires_at = leasework.now() + interval '1 hour'"
            " WHERE id = %s",
            (other.id,),
        )
        with conn.transaction():
            rows = conn.execute(lease.FINISH_AND_CLAIM_QUEUED_ONE, params).fetchall()
            assert sorted(r[0] for r in rows) == [False, True], "no hand-on"

            def admit() -> None:
                got.append([c.id for c in lease.claim_runs(rival, ["job"], worker="w3", lease=LEASE, limit=3)])

            t = threading.Thread(target=admit, daemon=True)
            t.start()
            t.join(1.0)
            assert t.is_alive(), "the admit did not wait for the hand-on in flight"
        t.join(30)
        assert not t.is_alive()
    assert got == [[]], f"the admit took {got} past the cap"
    assert live(conn) == 2


def test_an_operators_cap_wins_over_the_declared_one_until_reset(conn: Conn) -> None:
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(6)])
    operations.declare_limits(conn, {"job": {"max_running": 1}, "other": {}})
    assert claim_one(conn, "w1") is not None
    assert claim_one(conn, "w2") is None
    cap(conn, max_running=3)
    # A worker starting again declares the same value: the operator's still wins.
    assert operations.declare_limits(conn, {"job": {"max_running": 1}}) == []
    assert claim_one(conn, "w2") is not None and claim_one(conn, "w3") is not None
    assert claim_one(conn, "w4") is None
    assert operations.reset_limits(conn, "job") == ["max_running"]
    assert live(conn) == 3 and claim_one(conn, "w4") is None  # 3 running, the declared 1 holds
    # None removes the declared cap until reset.
    cap(conn, max_running=None)
    assert claim_one(conn, "w4") is not None
    assert status.limits(conn) == []
    # A declaration without limits clears the row once no operator value is left.
    operations.reset_limits(conn, "job")
    assert [r["kind"] for r in status.limits(conn)] == ["job"]
    assert operations.declare_limits(conn, {"job": {}}) == ["job"]
    assert conn.execute("SELECT count(*) FROM leasework.kind_limits").fetchone() == (0,)


def test_bad_limits_are_refused_in_one_line_and_change_nothing(conn: Conn) -> None:
    make_app().enqueue(conn, "job", {})
    for bad, says in [
        ({"max_running": 0}, "max_running must be an integer from 1 to 100,000"),
        ({"max_running": True}, "max_running must be an integer"),
        ({"group_limit": "3"}, "group_limit must be an integer"),
        ({"rate": "100/10x"}, "write COUNT/PERIOD, such as 100/10s"),
        ({"rate": "0/1s"}, "out of range"),
        ({"rate": "5/8d"}, "out of range"),
        ({"rate_per": "key"}, "rate_per must be 'tenant' or 'group'"),
        ({"rate_per": "tenant"}, "needs a rate"),
        ({"speed": 3}, "unknown limit 'speed'"),
    ]:
        with pytest.raises(ConfigError, match=says) as caught:
            cap(conn, **bad)
        assert "\n" not in str(caught.value)
    with pytest.raises(NotFound, match="unknown kind 'nope'"):
        operations.set_limits(conn, "nope", max_running=1)
    assert conn.execute("SELECT count(*) FROM leasework.kind_limits").fetchone() == (0,)


# -- group_limit -------------------------------------------------------------------------------


def test_group_limit_lets_a_tenants_group_run_n_at_once(conn: Conn) -> None:
    app = make_app()
    ids = [app.enqueue(conn, "job", {}, tenant="ws", group="crm") for _ in range(4)]
    cap(conn, group_limit=3)
    # One run per tenant per claim statement (the limiter cannot see the statement's own
    # claims), so a batch claim takes one, and three claims take three.
    assert [c.id for c in lease.claim_runs(conn, ["job"], worker="w", lease=LEASE, limit=5)] == [
        ids[0]
    ]
    second, third = claim_one(conn, "w2"), claim_one(conn, "w3")
    assert second is not None and third is not None
    assert claim_one(conn, "w4") is None, "a fourth run of a group limited to 3 was claimed"
    assert lease.finish(conn, second, "succeeded")
    fourth = claim_one(conn, "w4")
    assert fourth is not None and fourth.id == ids[3]


def test_group_limit_counts_the_groups_runs_of_every_kind(conn: Conn) -> None:
    app = make_app()
    cap(conn, group_limit=2)
    app.enqueue(conn, "job", {}, tenant="ws", group="g")
    other = app.enqueue(conn, "other", {}, tenant="ws", group="g")
    more = app.enqueue(conn, "job", {}, tenant="ws", group="g")
    assert claim_one(conn, "w1", kinds=["job"]) is not None
    # `other` sets no group_limit: a group is one at a time for its runs.
    assert claim_one(conn, "w2", kinds=["other"]) is None
    # `job` allows 2: its second run goes.
    second = claim_one(conn, "w3", kinds=["job"])
    assert second is not None and second.id == more
    assert lease.finish(conn, second, "succeeded")
    assert claim_one(conn, "w2", kinds=["other"]) is None
    del other


def test_an_exclusive_run_stays_exclusive_in_a_wider_group(conn: Conn) -> None:
    app = make_app()
    cap(conn, group_limit=3)
    a = app.enqueue(conn, "job", {}, tenant="ws", group="g")
    purge = app.enqueue(conn, "job", {}, tenant="ws", group="g", exclusive=True)
    later = app.enqueue(conn, "job", {}, tenant="ws", group="g")
    first = claim_one(conn, "w1")
    assert first is not None and first.id == a
    nxt = claim_one(conn, "w2")
    assert nxt is not None and nxt.id == later  # the exclusive run waits for `a`
    assert lease.finish(conn, first, "succeeded") and lease.finish(conn, nxt, "succeeded")
    excl = claim_one(conn, "w3")
    assert excl is not None and excl.id == purge
    app.enqueue(conn, "job", {}, tenant="ws", group="g")
    assert claim_one(conn, "w4") is None, "a run of the tenant was claimed beside its exclusive run"


def test_a_reclaim_in_a_full_group_waits(conn: Conn) -> None:
    app = make_app()
    cap(conn, group_limit=2)
    crashed = app.enqueue(conn, "job", {}, tenant="ws", group="g")
    app.enqueue_many(conn, "job", [{}, {}], tenant="ws", group="g")
    assert claim_one(conn, "dead") is not None
    assert claim_one(conn, "w2") is not None
    expire_lease(conn, crashed)
    third = claim_one(conn, "w3")
    assert third is not None  # the crashed run's place freed: one run (the reclaim) goes
    assert claim_one(conn, "w4") is None
    rows = conn.execute(
        "SELECT count(*) FROM leasework.runs WHERE status = 'running'"
        " AND lease_expires_at >= leasework.now()"
    ).fetchone()
    assert rows == (2,)


def test_a_reclaim_is_held_to_the_group_limit_too(conn: Conn) -> None:
    # A reclaim is re-checked by leasework.limiter_conflict alone: expired leases are few.
    app = make_app()
    cap(conn, "job", group_limit=2)
    cap(conn, "other", group_limit=2)
    crashed = app.enqueue(conn, "job", {}, tenant="ws", group="g")
    assert claim_one(conn, "dead", kinds=["job"]) is not None
    expire_lease(conn, crashed)
    app.enqueue_many(conn, "other", [{}, {}], tenant="ws", group="g")
    assert claim_one(conn, "w1", kinds=["other"]) is not None
    assert claim_one(conn, "w2", kinds=["other"]) is not None
    assert claim_one(conn, "w3", kinds=["job"]) is None, "a reclaim overfilled a group"


def test_a_full_kind_does_not_hold_back_its_tenants_other_runs(conn: Conn) -> None:
    # The claim leaves a kind at its cap out of the tenants' walk (leasework.kind_open), so a
    # tenant whose best run is of that kind gets its next run of another kind.
    app = make_app()
    cap(conn, max_running=1)
    app.enqueue(conn, "job", {})
    app.enqueue(conn, "job", {}, tenant="ws")
    other = app.enqueue(conn, "other", {}, tenant="ws")
    assert claim_one(conn, "w1") is not None  # the run without a tenant fills the cap
    nxt = claim_one(conn, "w2")
    assert nxt is not None and nxt.id == other


def running(conn: Conn, run_id: int, worker: str = "rival") -> None:
    """Mark a run running with a live lease, as a rival worker's claim would."""
    conn.execute(
        "UPDATE leasework.runs SET status = 'running', attempts = 1,"
        " lease_owner = gen_random_uuid(), lease_worker = %s,"
        " lease_expires_at = leasework.now() + interval '30 seconds',"
        " started_at = leasework.now() WHERE id = %s",
        (worker, run_id),
    )


def test_limiter_conflict_counts_a_group_up_to_its_kinds_limit(conn: Conn) -> None:
    app = make_app()
    ours = app.enqueue(conn, "job", tenant="ws", group="g")
    a, b = (app.enqueue(conn, "other", tenant="ws", group="g") for _ in range(2))

    def conflict() -> bool:
        row = conn.execute("SELECT leasework.limiter_conflict(%s)", (ours,)).fetchone()
        assert row is not None
        return bool(row[0])

    running(conn, a)
    assert conflict()  # no group_limit: a group is one at a time
    cap(conn, group_limit=2)
    assert not conflict()
    running(conn, b)
    assert conflict(), "a third run in a group limited to 2 passed the re-check"


GATE = 74208  # an advisory lock the statement under test waits on, after its snapshot

ADMIT = """
WITH gate AS MATERIALIZED (SELECT pg_advisory_xact_lock_shared(%(gate)s) AS g)
SELECT leasework.admit(ARRAY[%(run)s]::bigint[], ARRAY['job'], ARRAY[NULL]::text[], 1, NULL,
                       'w') AS taken,
       EXISTS (SELECT 1 FROM leasework.runs o
                WHERE o.id = %(rival)s AND o.status = 'running') AS stale
  FROM gate
"""


def test_admit_counts_a_rivals_claim_committed_mid_statement(conn: Conn, dsn: str) -> None:
    # The statement's snapshot predates the rival's claim; leasework.admit, under the kind's lock,
    # counts it all the same (a fresh snapshot): the cap of 1 is full.
    app = make_app()
    ours, rival = app.enqueue(conn, "job", {}), app.enqueue(conn, "job", {})
    cap(conn, max_running=1)
    with (
        psycopg.connect(dsn, autocommit=True) as holder,
        psycopg.connect(dsn, autocommit=True) as checker,
    ):
        holder.execute("SELECT pg_advisory_lock(%s)", (GATE,))
        result: list[Any] = []
        t = threading.Thread(
            target=lambda: result.append(
                checker.execute(ADMIT, {"gate": GATE, "run": ours, "rival": rival}).fetchone()
            ),
            daemon=True,
        )
        t.start()
        pid = checker.info.backend_pid
        wait_for(
            lambda: conn.execute(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            == (True,)
        )
        running(conn, rival)
        holder.execute("SELECT pg_advisory_unlock(%s)", (GATE,))
        t.join(10)
        assert not t.is_alive()
    assert result == [([], False)], "admit must count the rival the statement's snapshot cannot"
