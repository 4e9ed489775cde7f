"""Races on real Postgres, each racer on its own connection: claims never double up, the limiter
holds under concurrent claims, and racing enqueues for one key give one run."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import psycopg
import pytest

from leasework import App
from leasework.leases import lease

from ...conftest import get_run, wait_for
from ..checks import KINDS, LEASE, make_app

Conn = psycopg.Connection[Any]

LIVE_CONFLICTS = """
SELECT count(*)
  FROM leasework.runs a
  JOIN leasework.runs b ON a.tenant = b.tenant AND a.id < b.id
 WHERE a.status = 'running' AND b.status = 'running'
   AND a.lease_expires_at >= leasework.now() AND b.lease_expires_at >= leasework.now()
   AND (a.exclusive OR b.exclusive OR a."group" = b."group")
"""


@pytest.fixture
def connections(dsn: str) -> Iterator[Callable[[int], list[Conn]]]:
    with ExitStack() as stack:

        def open_many(n: int) -> list[Conn]:
            return [stack.enter_context(psycopg.connect(dsn, autocommit=True)) for _ in range(n)]

        yield open_many


def run_threads(targets: list[Callable[[], None]], timeout: float = 30.0) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def inner() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        return inner

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a racer did not finish in time"
    if errors:
        raise errors[0]


def test_racing_claims_never_double_claim(conn: Conn, connections: Any) -> None:
    app = make_app()
    total = 240
    with conn.transaction():
        for i in range(total):
            # Untenanted runs, and tenanted ones whose tenant rows the racers fight over.
            tenant = None if i % 3 == 0 else f"ws-{i % 7}"
            app.enqueue(conn, "job", {"i": i}, tenant=tenant)
    racers = connections(8)
    claimed: list[tuple[int, Any, str]] = []
    lock = threading.Lock()
    start = threading.Barrier(len(racers))
    deadline = time.monotonic() + 25

    def racer(c: Conn, name: str, seed: int) -> Callable[[], None]:
        rand = random.Random(seed)

        def go() -> None:
            start.wait()
            while time.monotonic() < deadline:
                with lock:
                    if len(claimed) >= total:
                        return
                claims = lease.claim_runs(
                    c, KINDS, worker=name, lease=LEASE, limit=rand.randint(1, 4)
                )
                with lock:
                    claimed.extend((cl.id, cl.owner, name) for cl in claims)

        return go

    run_threads([racer(c, f"w{i}", i) for i, c in enumerate(racers)])
    ids = [c[0] for c in claimed]
    assert len(ids) == len(set(ids)), "a run was claimed twice"
    assert len(ids) == total
    rows = conn.execute(
        "SELECT count(*), count(DISTINCT lease_owner), max(attempts) FROM leasework.runs"
        " WHERE status = 'running'"
    ).fetchone()
    assert rows == (total, total, 1)
    owners = {
        r[0]: r[1] for r in conn.execute("SELECT id, lease_owner FROM leasework.runs").fetchall()
    }
    assert all(owners[i] == owner for i, owner, _ in claimed)


class LimiterRace:
    """What the racers of a limiter race share: the runs to finish, a stop once all are, and the
    conflicts seen, by a racer holding a claim (its id) or by the monitor (-1)."""

    def __init__(self, ids: list[int], racers: int, seconds: float = 25.0) -> None:
        self.ids = set(ids)
        self.done: set[int] = set()
        self.violations: list[int] = []
        self.stop = threading.Event()
        self.start = threading.Barrier(racers)
        self.seconds = seconds
        self._lock = threading.Lock()

    def racing(self, deadline: float) -> bool:
        return not self.stop.is_set() and time.monotonic() < deadline

    def holding(self, c: Conn, run_id: int, rand: random.Random) -> None:
        """A racer holds `run_id`'s lease: no conflicting run may hold one now. Sometimes it
        holds the lease a moment before it finishes."""
        conflicts = c.execute(LIVE_CONFLICTS).fetchone()
        assert conflicts is not None
        if conflicts[0]:
            self.violations.append(run_id)
        if rand.random() < 0.5:
            c.execute("SELECT pg_sleep(0.002)")

    def finished(self, run_id: int) -> None:
        with self._lock:
            self.done.add(run_id)
            if self.done == self.ids:
                self.stop.set()

    def watch(self, conn: Conn, racers: list[Callable[[], None]]) -> None:
        """Run the racers beside a monitor that checks, one snapshot at a time until every run
        is finished, that no two conflicting runs of a tenant hold live leases; then that none
        did and that every run succeeded."""

        def monitor() -> None:
            while not self.stop.is_set():
                row = conn.execute(LIVE_CONFLICTS).fetchone()
                assert row is not None
                if row[0]:
                    self.violations.append(-1)

        run_threads([monitor, *racers])
        assert not self.violations, "two conflicting runs of one tenant held live leases at once"
        assert self.done == self.ids
        assert {r[0] for r in conn.execute("SELECT DISTINCT status FROM leasework.runs")} == {
            "succeeded"
        }


def test_racing_claims_respect_the_limiter(conn: Conn, connections: Any) -> None:
    """Racers claim, hold briefly and finish runs of one tenant while a monitor checks, in one
    snapshot at a time, that no two conflicting runs hold live leases at once."""
    app = make_app()
    plan = [("g1", False)] * 12 + [("g2", False)] * 12 + [(None, True)] * 6 + [("g1", True)] * 4
    random.Random(3).shuffle(plan)
    with conn.transaction():
        ids = [app.enqueue(conn, "job", tenant="ws-1", group=g, exclusive=x) for g, x in plan]
    racers = connections(6)
    race = LimiterRace(ids, len(racers))

    def racer(c: Conn, name: str, seed: int) -> Callable[[], None]:
        rand = random.Random(seed)

        def go() -> None:
            race.start.wait()
            deadline = time.monotonic() + race.seconds
            while race.racing(deadline):
                for claim in lease.claim_runs(c, KINDS, worker=name, lease=LEASE, limit=2):
                    race.holding(c, claim.id, rand)
                    assert lease.finish(c, claim, "succeeded")
                    race.finished(claim.id)

        return go

    race.watch(conn, [racer(c, f"w{i}", i) for i, c in enumerate(racers)])


@pytest.mark.parametrize("chained", [False, True], ids=["whole", "chain"])
def test_racing_seals_with_the_next_claim_respect_the_limiter(
    conn: Conn, connections: Any, chained: bool
) -> None:
    """One-at-a-time mode's steady state under a race: each racer seals its run in the same
    statement as its next claim (lease.finish_and_claim: the whole statement, or a Chain's quick
    one first), runs of two tenants with groups and exclusive runs among them, while a monitor
    checks that no two conflicting runs of a tenant ever hold live leases at once."""
    app = make_app()
    plan = [("g1", False)] * 10 + [("g2", False)] * 10 + [(None, True)] * 4 + [("g1", True)] * 4
    random.Random(5).shuffle(plan)
    with conn.transaction():
        ids = [
            app.enqueue(conn, "job", tenant=f"ws-{i % 2}", group=g, exclusive=x)
            for i, (g, x) in enumerate(plan)
        ]
        ids += [app.enqueue(conn, "job") for _ in range(8)]  # and some without a tenant
    racers = connections(4)
    race = LimiterRace(ids, len(racers))

    def racer(c: Conn, name: str, seed: int) -> Callable[[], None]:
        rand = random.Random(seed)
        chain = lease.Chain() if chained else None

        def go() -> None:
            race.start.wait()
            deadline = time.monotonic() + race.seconds
            held: lease.Claim | None = None
            while race.racing(deadline):
                if held is None:
                    claims = lease.claim_runs(c, KINDS, worker=name, lease=LEASE)
                    held = claims[0] if claims else None
                    if held is None:
                        time.sleep(0.001)  # every run left is held by another racer: poll again
                        continue
                race.holding(c, held.id, rand)
                sealed, nxt = lease.finish_and_claim(
                    c, held, KINDS, worker=name, lease=LEASE, chain=chain
                )
                assert sealed
                race.finished(held.id)
                held = nxt
            if held is not None:  # stopped by the deadline holding one: the test fails below
                lease.finish(c, held, "succeeded")

        return go

    race.watch(conn, [racer(c, f"w{i}", i) for i, c in enumerate(racers)])


def claim_at_once(racers: list[Conn]) -> list[lease.Claim]:
    barrier = threading.Barrier(len(racers))
    got: list[lease.Claim] = []

    def racer(c: Conn, name: str) -> Callable[[], None]:
        def go() -> None:
            barrier.wait()
            got.extend(lease.claim_runs(c, KINDS, worker=name, lease=LEASE, limit=3))

        return go

    run_threads([racer(c, f"w{i}") for i, c in enumerate(racers)])
    return got


def test_racing_claims_for_one_tenant_take_one_run(conn: Conn, connections: Any) -> None:
    """Round after round, eight racers fire the claim at once for a tenant with a queue of
    same-group runs: exactly one run is taken per round."""
    app = make_app()
    with conn.transaction():
        for _ in range(10):
            app.enqueue(conn, "job", tenant="ws-1", group="procore")
    racers = connections(8)
    for _round in range(10):
        got = claim_at_once(racers)
        assert len(got) <= 1, f"{len(got)} runs of one tenant and group claimed at once"
        if not got:  # every racer skipped the tenant row another held: try the round again
            continue
        assert lease.finish(conn, got[0], "succeeded")
    left = conn.execute("SELECT count(*) FROM leasework.runs WHERE status = 'queued'").fetchone()
    assert left is not None and left[0] <= 9


def test_two_workers_polling_execute_each_run_once(conn: Conn, make_worker: Any) -> None:
    app = App()
    executed: list[tuple[int, str]] = []

    @app.task("job")
    def job(ctx: Any, payload: Any) -> dict[str, int]:
        ctx.check()
        executed.append((ctx.run_id, ctx.worker_id))
        return {"i": payload["i"]}

    total = 40
    with conn.transaction():
        ids = [app.enqueue(conn, "job", {"i": i}) for i in range(total)]
    workers = [make_worker(app, runs_limit=3) for _ in range(3)]
    start = threading.Barrier(len(workers))

    def polling(w: Any) -> Callable[[], None]:
        def go() -> None:
            start.wait()
            deadline = time.monotonic() + 25
            while len(executed) < total and time.monotonic() < deadline:
                w.poll()

        return go

    run_threads([polling(w) for w in workers])
    ran = [run_id for run_id, _ in executed]
    assert sorted(ran) == sorted(ids), "a run was executed twice or not at all"
    assert len({w for _, w in executed}) > 1, "only one worker did anything"
    statuses = conn.execute(
        "SELECT status, max(attempts) FROM leasework.runs GROUP BY 1"
    ).fetchall()
    assert statuses == [("succeeded", 1)]


def _blocked_pids(monitor: Conn) -> set[int]:
    rows = monitor.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock'"
    ).fetchall()
    return {r[0] for r in rows}


def race_enqueues(conn: Conn, racers: list[Conn], enqueue: Callable[[Conn], int]) -> list[int]:
    """Each racer enqueues in its own transaction; a racer that got through holds its
    transaction open until every other racer has either got through or is blocked on it."""
    pids = [c.info.backend_pid for c in racers]
    through: set[int] = set()
    results: list[int] = []
    barrier = threading.Barrier(len(racers))
    lock = threading.Lock()

    def racer(c: Conn) -> Callable[[], None]:
        def go() -> None:
            with c.transaction():
                barrier.wait()
                run_id = enqueue(c)
                with lock:
                    through.add(c.info.backend_pid)
                    results.append(run_id)
                with psycopg.connect(conn.info.dsn, autocommit=True) as monitor:
                    wait_for(
                        lambda: all(
                            p in through or p in _blocked_pids(monitor)
                            for p in pids
                            if p != c.info.backend_pid
                        )
                    )

        return go

    run_threads([racer(c) for c in racers])
    return results


def test_three_racing_enqueues_for_one_key_give_one_run(conn: Conn, connections: Any) -> None:
    app = make_app()
    results = race_enqueues(
        conn, connections(3), lambda c: app.enqueue(c, "job", {"tab": 1}, key="conn-7", tenant="ws")
    )
    assert len(results) == 3 and len(set(results)) == 1
    rows = conn.execute("SELECT id, status FROM leasework.runs").fetchall()
    assert rows == [(results[0], "queued")]
    tenants = conn.execute("SELECT name FROM leasework.tenants").fetchall()
    assert tenants == [("ws",)]


def test_three_racing_exclusive_enqueues_give_one_waiting_run(conn: Conn, connections: Any) -> None:
    app = make_app()
    active = app.enqueue(conn, "job", key="conn-7")
    results = race_enqueues(
        conn, connections(3), lambda c: app.enqueue(c, "other", key="conn-7", exclusive=True)
    )
    assert len(set(results)) == 1 and results[0] != active
    assert get_run(conn, results[0])["status"] == "waiting"
    count = conn.execute("SELECT count(*) FROM leasework.runs").fetchone()
    assert count == (2,)
