"""Races on real Postgres for unique windows and debounce: several threads, each on its own
connection, enqueue one key at once (each enqueue alone or in a transaction of its own) while
another worker claims and ends its runs; hypothesis draws the schedule. A unique window keeps one
run per window (a second run of the key inside a window only after the first failed or was
cancelled); a debounce keeps one pending run per key, and with a union as its merge no enqueue's
payload is lost or counted twice. Database time moves between phases by the clock of every
connection at once (never by sleeping)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leasework import Enqueued
from leasework.leases import lease

from ...conftest import shift_clock, truncate_all
from ..checks import KINDS, LEASE, make_app, merge_union

Conn = psycopg.Connection[Any]

WINDOW = 650.0  # seconds; phases are STEP apart: 0, 300, 600 inside a window, 900 past it
STEP = 300.0
TENANT = st.sampled_from([None, "ws"])


@pytest.fixture
def connections(dsn: str) -> Iterator[list[Conn]]:
    """Five autocommit connections (four racers and a worker), kept for every example."""
    with ExitStack() as stack:
        yield [stack.enter_context(psycopg.connect(dsn, autocommit=True)) for _ in range(5)]


def run_threads(targets: list[Callable[[], None]], timeout: float = 60.0) -> None:
    """Start them together (a barrier), join them; re-raise the first error of any."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(targets))

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def inner() -> None:
            try:
                start.wait()
                fn()
            except BaseException as exc:
                errors.append(exc)

        return inner

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a racer hung"
    if errors:
        raise errors[0]


def enqueue_in(c: Conn, alone: bool, enqueue: Callable[[Conn], Enqueued]) -> Enqueued:
    if alone:
        return enqueue(c)
    with c.transaction():
        return enqueue(c)


# A phase: the clock's steps before it (of STEP), each racer's enqueues (its tenant, alone or in
# a transaction), and what the worker does meanwhile to the key's runs.
WINDOW_PHASE = st.tuples(
    st.integers(min_value=0, max_value=3),
    st.lists(
        st.lists(st.tuples(TENANT, st.booleans()), min_size=1, max_size=3), min_size=2, max_size=4
    ),
    st.lists(st.sampled_from(["succeeded", "partial", "failed", "cancel"]), max_size=3),
)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(WINDOW_PHASE, min_size=1, max_size=4))
def test_racing_enqueues_with_unique_for_keep_one_run_per_window(
    conn: Conn, connections: list[Conn], phases: list[Any]
) -> None:
    truncate_all(conn)
    app = make_app()
    worker = connections[-1]
    offset = 0.0
    made: list[tuple[int, str | None, float]] = []  # new runs: id, tenant, the phase's clock
    returned: list[tuple[int, str | None]] = []
    lock = threading.Lock()
    for steps, racers, actions in phases:
        offset += steps * STEP
        for c in connections:
            shift_clock(c, offset)

        def racer(
            c: Conn, plan: list[tuple[str | None, bool]], at: float = offset
        ) -> Callable[[], None]:
            def go() -> None:
                for tenant, alone in plan:
                    done = enqueue_in(
                        c,
                        alone,
                        lambda c, tenant=tenant: app.enqueue_run(
                            c, "job", {"t": tenant}, key="acct-7", tenant=tenant, unique_for=WINDOW
                        ),
                    )
                    with lock:
                        returned.append((done.run_id, tenant))
                        if not done.existing:
                            made.append((done.run_id, tenant, at))

            return go

        def work(actions: list[str] = actions) -> None:
            for action in actions:
                if action == "cancel":
                    row = worker.execute(
                        "SELECT id FROM leasework.runs WHERE status = 'queued' ORDER BY id LIMIT 1"
                    ).fetchone()
                    if row is not None:
                        app.cancel(worker, row[0])
                    continue
                for claim in lease.claim_runs(worker, KINDS, worker="w", lease=LEASE, limit=1):
                    assert lease.finish(
                        worker, claim, action, error=None if action != "failed" else "x"
                    )

        run_threads([racer(c, plan) for c, plan in zip(connections, racers, strict=False)] + [work])

    rows = conn.execute("SELECT id, key, tenant, status, unique_at FROM leasework.runs").fetchall()
    runs = {r[0]: r for r in rows}
    for run_id, tenant in returned:
        assert runs[run_id][1] == "acct-7" and runs[run_id][2] == tenant, (
            f"an enqueue of tenant {tenant!r} returned run {run_id} of another key or tenant"
        )
    for tenant in (None, "ws"):
        mine = sorted((i, at) for i, t, at in made if t == tenant)
        for n, (first, first_at) in enumerate(mine):
            for later, later_at in mine[n + 1 :]:
                if later_at - first_at < WINDOW:
                    assert runs[first][3] in ("failed", "cancelled"), (
                        f"tenant {tenant!r}: runs {first} and {later} of one window "
                        f"({later_at - first_at:g} s apart) and {first} is {runs[first][3]}"
                    )
        marked = [i for i, r in runs.items() if r[2] == tenant and r[4] is not None]
        assert marked == ([mine[-1][0]] if mine else []), (
            f"tenant {tenant!r}: the window run is {marked}, not the newest run made"
        )


# A racer's enqueues: how many, each alone or in a transaction; the worker's actions meanwhile:
# claim (and succeed) a run that is due to it, or settle (promote a waiting run).
DEBOUNCE_RACERS = st.lists(st.lists(st.booleans(), min_size=1, max_size=4), min_size=2, max_size=4)
DEBOUNCE_WORK = st.lists(st.sampled_from(["claim", "settle"]), max_size=6)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(DEBOUNCE_RACERS, DEBOUNCE_WORK, st.booleans(), TENANT)
def test_racing_debounced_enqueues_keep_one_pending_run_and_lose_no_payload(
    conn: Conn,
    connections: list[Conn],
    racers: list[list[bool]],
    actions: list[str],
    merge: bool,
    tenant: str | None,
) -> None:
    """Each enqueue carries one item of its own. With a union as the merge, every item ends in
    exactly one run of the key (none lost when a run was claimed mid-merge, none written over by
    a racing merge); with or without it, the debounce counts add up to the enqueues (each made a
    run or was merged into one) and the key never has two queued runs."""
    truncate_all(conn)
    app = make_app()
    worker = connections[-1]
    shift_clock(worker, 10_000)  # every debounced run is due to the worker
    for c in connections[:-1]:
        shift_clock(c, 0)
    counter = iter(range(10_000))
    lock = threading.Lock()

    def racer(c: Conn, plan: list[bool]) -> Callable[[], None]:
        def go() -> None:
            for alone in plan:
                with lock:
                    item = next(counter)
                enqueue_in(
                    c,
                    alone,
                    lambda c, item=item: app.enqueue_run(
                        c,
                        "job",
                        {"items": [item]},
                        key="doc-7",
                        tenant=tenant,
                        debounce=600,
                        debounce_merge=merge_union if merge else None,
                    ),
                )
                queued = c.execute(
                    "SELECT count(*) FROM leasework.runs WHERE status = 'queued'"
                ).fetchone()
                assert queued is not None and queued[0] <= 1, "two queued runs of one key"

        return go

    def work() -> None:
        for action in actions:
            if action == "settle":
                lease.expire_and_promote(worker, 100)
                continue
            for claim in lease.claim_runs(worker, KINDS, worker="w", lease=LEASE, limit=1):
                assert lease.finish(worker, claim, "succeeded")

    run_threads([racer(c, plan) for c, plan in zip(connections, racers, strict=False)] + [work])

    enqueued = sum(len(plan) for plan in racers[: len(connections) - 1])
    rows = conn.execute(
        "SELECT id, status, payload, debounce_count, key, tenant FROM leasework.runs ORDER BY id"
    ).fetchall()
    assert all(r[4] == "doc-7" and r[5] == tenant for r in rows)
    assert sum(r[3] for r in rows) == enqueued, (
        f"the debounce counts {[r[3] for r in rows]} do not add up to {enqueued} enqueues"
    )
    statuses = [r[1] for r in rows]
    assert statuses.count("queued") <= 1 and statuses.count("waiting") <= 1, statuses
    if "claim" not in actions:
        assert len(rows) == 1, f"{len(rows)} runs for one key that nothing claimed"
    if merge:
        items = [i for r in rows for i in r[2]["items"]]
        assert sorted(items) == list(range(enqueued)), (
            f"items lost or doubled: {sorted(items)} of {enqueued}"
        )
