"""Flow control under concurrent claimers (migration 0023): several workers, each on its own
connection, claim at the same moment, round after round, with random caps, group limits and
rates, runs sealed and leases lost between rounds and the database clock moved on. After every
round: never more live leases of a capped kind than its max_running, never more in a tenant's
group than its group_limit, an exclusive run alone in its tenant. Over the whole history: in
every span of a rate's period, however placed, no more claims than its count (per kind, or per
tenant). Claims made by claim_runs, and by finish_and_claim through a Chain (the quick
statement, which hands a capped kind's place on and, in its rated form, records a rated kind's
claims)."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leasework import operations
from leasework.leases import lease

from ...conftest import expire_lease, shift_clock, truncate_all, wait_for
from ..checks import KINDS, LEASE, make_app

Conn = psycopg.Connection[Any]
RACERS = 4


@pytest.fixture
def racers(dsn: str) -> Iterator[list[Conn]]:
    with ExitStack() as stack:
        yield [stack.enter_context(psycopg.connect(dsn, autocommit=True)) for _ in range(RACERS)]


@dataclass(frozen=True)
class Limits:
    max_running: int | None
    group_limit: int | None
    rate: tuple[int, int] | None  # (count, seconds)
    per: str | None  # rate_per: None (the kind), "tenant" or "group"


LIMITS = st.builds(
    Limits,
    st.sampled_from([None, 1, 2, 3]),
    st.sampled_from([None, 1, 2, 3]),
    st.sampled_from([None, (1, 10), (2, 10), (3, 60), (5, 60)]),
    st.sampled_from([None, "tenant", "group"]),
)
RUN = st.tuples(
    st.sampled_from(["job", "job", "job", "other"]),
    st.sampled_from([None, "t1", "t2"]),
    st.sampled_from([None, "g", "g", "h"]),
    st.sampled_from([False, False, False, False, True]),  # exclusive
)
ROUND = st.tuples(
    st.lists(st.integers(1, 3), min_size=RACERS, max_size=RACERS),  # each racer's batch size
    st.integers(0, 3),  # leases sealed after the round
    st.booleans(),  # one lease lost (its worker died)
    st.sampled_from([0, 0, 1, 4, 9, 10.6, 30, 61]),  # seconds the clock moves on
    # Racers holding a run seal it and claim the next in one statement, through a Chain (the
    # quick statement hands a capped kind's place on), rather than claim with claim_runs.
    st.booleans(),
)


def race_round(
    racers: list[Conn],
    sizes: list[int],
    rnd: int,
    sealing: list[lease.Claim | None] | None = None,
    chains: list[lease.Chain] | None = None,
) -> list[lease.Claim]:
    """Every racer claims at once (a barrier), each with its batch size, or, where `sealing`
    gives it a run, seals that run and claims one in the same statement (finish_and_claim
    through its Chain); their claims."""
    start = threading.Barrier(len(racers))
    got: list[list[lease.Claim]] = [[] for _ in racers]
    errors: list[BaseException] = []

    def go(i: int) -> None:
        try:
            start.wait(10)
            run = sealing[i] if sealing else None
            if run is not None and chains is not None:
                _, nxt = lease.finish_and_claim(
                    racers[i], run, KINDS, worker=f"w{rnd}.{i}", lease=LEASE, chain=chains[i]
                )
                got[i] = [nxt] if nxt is not None else []
                return
            got[i] = lease.claim_runs(
                racers[i], KINDS, worker=f"w{rnd}.{i}", lease=LEASE, limit=sizes[i]
            )
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(i,), daemon=True) for i in range(len(racers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a racer did not finish in time"
    if errors:
        raise errors[0]
    return [c for claims in got for c in claims]


def live_leases(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute(
        'SELECT kind, tenant, "group", exclusive FROM leasework.runs'
        " WHERE status = 'running' AND lease_expires_at >= leasework.now()"
    ).fetchall()


def check_caps(conn: Conn, limits: Limits) -> None:
    rows = live_leases(conn)
    jobs = sum(1 for r in rows if r[0] == "job")
    if limits.max_running is not None:
        assert jobs <= limits.max_running, f"{jobs} runs of a kind capped at {limits.max_running}"
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for kind, tenant, group, _ in rows:
        if tenant is not None and group is not None:
            groups[(tenant, group)].append(kind)
    for (tenant, group), kinds in groups.items():
        # Each run is held to its own kind's limit: `other` has none (1), `job` group_limit.
        allowed = max(limits.group_limit or 1 if k == "job" else 1 for k in kinds)
        assert len(kinds) <= allowed, f"{len(kinds)} runs in {tenant}/{group} at once: {kinds}"
    for tenant in {r[1] for r in rows if r[1] is not None}:
        mine = [r for r in rows if r[1] == tenant]
        assert len(mine) == 1 or not any(r[3] for r in mine), f"{tenant}: exclusive not alone"


def check_rate(times: dict[Any, list[datetime]], count: int, seconds: int) -> None:
    """In every span of `seconds`, wherever it starts, at most `count` claims (per budget)."""
    for budget, stamps in times.items():
        stamps = sorted(stamps)
        for i, first in enumerate(stamps):
            within = [t for t in stamps[i:] if (t - first).total_seconds() <= seconds]
            assert len(within) <= count, (
                f"{len(within)} claims of budget {budget!r} within {seconds}s of {first} "
                f"(rate {count}/{seconds}s)"
            )


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(LIMITS, st.lists(RUN, min_size=6, max_size=24), st.lists(ROUND, min_size=3, max_size=7))
def test_no_claim_ever_admits_a_run_past_a_cap_or_a_rate(
    conn: Conn, racers: list[Conn], limits: Limits, queue: list[Any], rounds: list[Any]
) -> None:
    truncate_all(conn)
    offset = 0.0
    for c in [conn, *racers]:
        shift_clock(c, offset)
    app = make_app()
    for kind, tenant, group, exclusive in queue:
        app.enqueue(conn, kind, {}, tenant=tenant, group=group, exclusive=exclusive)
    changes: dict[str, Any] = {
        "max_running": limits.max_running,
        "group_limit": limits.group_limit,
        "rate": None if limits.rate is None else f"{limits.rate[0]}/{limits.rate[1]}s",
        "rate_per": limits.per if limits.rate is not None else None,
    }
    operations.set_limits(conn, "job", known=KINDS, **changes)
    held: list[lease.Claim] = []
    times: dict[Any, list[datetime]] = defaultdict(list)
    chains = [lease.Chain() for _ in racers]
    for kept in chains[1::2]:
        kept.rated = True  # the quick statement's rated form (it records a rated kind's claims)
    for rnd, (sizes, seals, crash, move, chained) in enumerate(rounds):
        sealing: list[lease.Claim | None] = [None] * len(racers)
        if chained:
            for i in range(min(len(racers), len(held))):
                sealing[i] = held.pop(0)
        claims = race_round(racers, sizes, rnd, sealing, chains)
        for claim in claims:
            if claim.kind == "job":
                row = conn.execute(
                    'SELECT started_at, "group" FROM leasework.runs WHERE id = %s', (claim.id,)
                ).fetchone()
                assert row is not None
                # Each budget: rated per tenant a tenant's; per group a tenant's group's (its
                # runs without a group: the tenant's); runs without a tenant share one.
                budget: Any = None
                if limits.per is not None and claim.tenant is not None:
                    budget = (claim.tenant, row[1] if limits.per == "group" else None)
                times[budget].append(row[0])
        held.extend(claims)
        check_caps(conn, limits)
        for claim in held[:seals]:
            lease.finish(conn, claim, "succeeded")
        held = held[seals:]
        if crash and held:
            expire_lease(conn, held.pop(0).id)  # reclaimable now, through the same admission
        offset += move
        for c in [conn, *racers]:
            shift_clock(c, offset)
    if limits.rate is not None:
        check_rate(times, *limits.rate)


@pytest.mark.parametrize("chain", [False, True], ids=["whole", "chained"])
@pytest.mark.parametrize(
    "rate",
    # A cap alone is handed on from run to run by the chained quick statement (lease.sql,
    # handed_on); with a rate too, every claim is admitted.
    [pytest.param("100000/1s", id="cap-and-rate"), pytest.param(None, id="cap")],
)
def test_workers_sealing_and_claiming_a_capped_kind_never_wait_on_each_other(
    conn: Conn, racers: list[Conn], chain: bool, rate: str | None
) -> None:
    # Each racer seals its run and claims the next in one statement (finish_and_claim), as a
    # worker does one at a time, with the lock_timeout workers run with: a claim that waited on
    # another (they once deadlocked: a claim's scan keeps a lock on a run it skipped, which its
    # worker was sealing while it waited for the kind's row) fails here with a lock timeout.
    app = make_app()
    total = 300
    app.enqueue_many(conn, "job", [{} for _ in range(total)])
    operations.set_limits(conn, "job", known=KINDS, max_running=3, rate=rate)
    for c in racers:
        c.execute("SET lock_timeout = '500ms'")
    done: list[int] = []
    errors: list[BaseException] = []
    over: list[int] = []
    start = threading.Barrier(len(racers))

    def drain(i: int) -> None:
        c = racers[i]
        kept = lease.Chain() if chain else None
        try:
            start.wait(10)
            claims = lease.claim_runs(c, ["job"], worker=f"w{i}", lease=LEASE)
            claim = claims[0] if claims else None
            while claim is not None:
                live = c.execute(
                    "SELECT count(*) FROM leasework.runs WHERE kind = 'job'"
                    " AND status = 'running' AND lease_expires_at >= leasework.now()"
                ).fetchone()
                if live is not None and live[0] > 3:
                    over.append(live[0])
                done.append(claim.id)
                _, claim = lease.finish_and_claim(
                    c, claim, ["job"], worker=f"w{i}", lease=LEASE, chain=kept
                )
                if claim is None:  # the cap was full when it asked: ask again until none is due
                    left = c.execute(
                        "SELECT count(*) FROM leasework.runs WHERE status = 'queued'"
                    ).fetchone()
                    if left and left[0]:
                        claims = lease.claim_runs(c, ["job"], worker=f"w{i}", lease=LEASE)
                        claim = claims[0] if claims else None
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a racer did not finish in time"
    assert not errors, errors[0]
    assert not over, f"{max(over)} runs of a kind capped at 3 held live leases at once"
    assert sorted(done) == sorted(set(done)) and len(done) == total


def test_racing_rated_quick_claims_never_pass_the_rate(conn: Conn, racers: list[Conn]) -> None:
    # Each racer seals and claims through the quick statement's rated form as fast as it can: the
    # window's room each sees in its snapshot is only a hint, the kind's row decides. Exactly the
    # rate's count is claimed, never one more.
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(200)])
    count = 40
    operations.set_limits(conn, "job", known=KINDS, rate=f"{count}/600s")
    firsts = [lease.claim_runs(c, ["job"], worker=f"w{i}", lease=LEASE) for i, c in enumerate(racers)]
    claimed: list[int] = [claims[0].id for claims in firsts if claims]
    errors: list[BaseException] = []
    start = threading.Barrier(len(racers))

    def drain(i: int) -> None:
        kept = lease.Chain(recheck=0.0)
        kept.rated = True
        claim = firsts[i][0] if firsts[i] else None
        try:
            start.wait(10)
            while claim is not None:
                _, claim = lease.finish_and_claim(
                    racers[i], claim, ["job"], worker=f"w{i}", lease=LEASE, chain=kept
                )
                if claim is not None:
                    claimed.append(claim.id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a racer did not finish in time"
    assert not errors, errors[0]
    assert len(claimed) == len(set(claimed))
    assert len(claimed) <= count, f"{len(claimed)} claims under a rate of {count} per 600 s"
    row = conn.execute(
        "SELECT count(*) FROM leasework.runs WHERE kind = 'job' AND started_at IS NOT NULL"
    ).fetchone()
    assert row is not None and row[0] == len(claimed)


# finish_and_claim_rated with its shard's room read in the statement's snapshot alone: a subquery
# there reads the version the snapshot saw, also when FOR UPDATE re-checks the row it locked (a
# rival's claim committed meanwhile is not counted). What the shard's re-check guards against.
# (The statement's text as queries.load compacts it.)
_ROOM = (
    b"WHERE z.carried IS NULL"
    b" AND leasework.rate_used_fast(z.win,z.seconds,leasework.now()) < z.share"
)
_ROOM_IN_THE_SNAPSHOT = (
    b"WHERE (SELECT v.carried IS NULL"
    b" AND leasework.rate_used_fast(v.win,z.seconds,leasework.now()) < v.share"
    b" FROM leasework.rate_shards v WHERE v.kind = z.kind AND v.shard = z.shard)"
)


def drain_rated(conn: Conn, racers: list[Conn], count: int) -> int:
    """Racers seal and claim through the quick statement's rated form as fast as they can,
    under a rate of `count` per 600 s (its window in shards): how many runs they claimed in all,
    each started once (checked)."""
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(200)])
    operations.set_limits(conn, "job", known=KINDS, rate=f"{count}/600s")
    firsts = [lease.claim_runs(c, ["job"], worker=f"w{i}", lease=LEASE) for i, c in enumerate(racers)]
    claimed: list[int] = [claims[0].id for claims in firsts if claims]
    errors: list[BaseException] = []
    start = threading.Barrier(len(racers))

    def drain(i: int) -> None:
        kept = lease.Chain(recheck=0.0)
        kept.rated = True
        claim = firsts[i][0] if firsts[i] else None
        try:
            start.wait(10)
            while claim is not None:
                _, claim = lease.finish_and_claim(
                    racers[i], claim, ["job"], worker=f"w{i}", lease=LEASE, chain=kept
                )
                if claim is not None:
                    claimed.append(claim.id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a racer did not finish in time"
    assert not errors, errors[0]
    assert len(claimed) == len(set(claimed))
    row = conn.execute(
        "SELECT count(*) FROM leasework.runs WHERE kind = 'job' AND started_at IS NOT NULL"
    ).fetchone()
    assert row is not None and row[0] == len(claimed)
    return len(claimed)


@pytest.mark.parametrize("count", [8, 12, 40])
def test_racing_claims_on_the_shards_never_pass_the_rate(
    conn: Conn, racers: list[Conn], count: int
) -> None:
    # 8 shards, each held to its share (1, 1 or 2, 5): the racers take shards with room, skip
    # those another holds, and re-check the one they lock. Never more than the rate in all.
    for attempt in range(3):
        truncate_all(conn)
        got = drain_rated(conn, racers, count)
        assert got <= count, f"{got} claims under a rate of {count} per 600 s (attempt {attempt})"


def claims_past_a_held_snapshot(conn: Conn, racers: list[Conn]) -> int:
    """The race of the test above, made certain: a worker's rated quick statement takes its
    snapshot and waits on the row lock of the run it seals (a third session holds it); meanwhile
    a rival seals and claims until the rate's window is full, every shard written since that
    snapshot; then the lock is let go. How many runs were claimed in all (each started once,
    checked)."""
    count = 8
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(50)])
    operations.set_limits(conn, "job", known=KINDS, rate=f"{count}/600s")
    late, rival, holder = racers[:3]
    first = lease.claim_runs(late, ["job"], worker="late", lease=LEASE)[0]
    claim: lease.Claim | None = lease.claim_runs(rival, ["job"], worker="rival", lease=LEASE)[0]
    assert claim is not None
    claimed = [first.id, claim.id]
    got: list[lease.Claim | None] = []
    errors: list[BaseException] = []

    def seal_and_claim() -> None:
        kept = lease.Chain(recheck=0.0)
        kept.rated = True
        try:
            _, nxt = lease.finish_and_claim(
                late, first, ["job"], worker="late", lease=LEASE, chain=kept
            )
            got.append(nxt)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    pid = late.info.backend_pid
    waiting = threading.Thread(target=seal_and_claim, daemon=True)
    with holder.transaction():
        holder.execute("SELECT 1 FROM leasework.runs WHERE id = %s FOR UPDATE", (first.id,))
        waiting.start()
        wait_for(
            lambda: conn.execute(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            == (True,),
            timeout=60,
        )
        kept = lease.Chain(recheck=0.0)
        kept.rated = True
        while claim is not None:
            _, claim = lease.finish_and_claim(
                rival, claim, ["job"], worker="rival", lease=LEASE, chain=kept
            )
            if claim is not None:
                claimed.append(claim.id)
        assert len(claimed) == count, f"the rival filled the window with {len(claimed)} claims"
    waiting.join(60)
    assert not waiting.is_alive(), "the waiting claim did not end"
    assert not errors, errors[0]
    claimed += [c.id for c in got if c is not None]
    assert len(claimed) == len(set(claimed))
    row = conn.execute(
        "SELECT count(*) FROM leasework.runs WHERE kind = 'job' AND started_at IS NOT NULL"
    ).fetchone()
    assert row is not None and row[0] == len(claimed)
    return len(claimed)


def test_a_claim_whose_snapshot_predates_a_rivals_claims_counts_them(
    conn: Conn, racers: list[Conn]
) -> None:
    # The shard the late statement locks was written since its snapshot: its room is read on the
    # version locked, full, and the claim takes nothing (nor does claim_runs after it).
    assert claims_past_a_held_snapshot(conn, racers) == 8


def test_the_shards_room_read_in_the_snapshot_passes_the_rate(
    conn: Conn, racers: list[Conn], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same race with the shard's room decided in the statement's snapshot (no re-check on the
    # version locked): the rival's claims committed meanwhile go uncounted, and the late claim
    # passes the rate. Shows that the two tests above can fail.
    for key, (text, name, _) in list(lease._QUICK_FORMS.items()):
        if key[2]:
            assert _ROOM in text
            broken = text.replace(_ROOM, _ROOM_IN_THE_SNAPSHOT)
            monkeypatch.setitem(
                lease._QUICK_FORMS, key,
                (broken, name + b"_broken", lease.wire.numbered(broken, lease.QUICK_PARAMS)),
            )  # fmt: skip
    assert claims_past_a_held_snapshot(conn, racers) == 9
