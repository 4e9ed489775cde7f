"""One-at-a-time mode's steady state: a success sealed in the same statement as the next claim
(lease.finish_and_claim). The seal stays owner-scoped and commits synchronously, the claim is
the ordinary claim, the statement never touches one row twice, and the runs stage falls back to
the separate finish wherever the combined statement does not apply. Each statement-level test
runs with both statements: the whole one and finish_and_claim_queued (a Chain that has seen
nothing else due), which must claim what the whole one would, tenanted runs and expired leases
included. A run with a tenant is sealed the same way; the limiter stays as strict."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from leasework import App, Context
from leasework.leases import lease
from leasework.workers.worker import Worker

from ...conftest import expire_lease, fast_config, get_run

Conn = psycopg.Connection[Any]
MakeWorker = Callable[..., Worker]


def enqueue(conn: Conn, n: int, kind: str = "k", tenant: str | None = None) -> list[int]:
    app = App()
    app.task(kind)(lambda ctx, p: None)
    return [app.enqueue(conn, kind, {"i": i}, tenant=tenant) for i in range(n)]


def claim_one(conn: Conn, kinds: list[str] | None = None) -> lease.Claim:
    claims = lease.claim_runs(conn, kinds or ["k"], worker="w1", lease=30.0)
    assert len(claims) == 1
    return claims[0]


@pytest.fixture(params=["whole", "quick", "lean"])
def chain(request: pytest.FixtureRequest) -> lease.Chain | None:
    """None: finish_and_claim's whole statement; a fresh Chain: the quick one first, probed; a
    Chain within its lean window: the quick one's lean form."""
    if request.param == "whole":
        return None
    return lean_chain() if request.param == "lean" else lease.Chain()


def lean_chain(recheck: float = 60.0) -> lease.Chain:
    """A Chain whose probed statement found nothing else due a moment ago (for ever, here)."""
    chain = lease.Chain(recheck=recheck)
    chain.lean_until = float("inf")
    return chain


def test_seals_the_run_and_claims_the_next(conn: Conn, chain: lease.Chain | None) -> None:
    first, second = enqueue(conn, 2)
    claim = claim_one(conn)
    assert claim.id == first

    sealed, nxt = lease.finish_and_claim(
        conn, claim, ["k"], worker="w1", lease=30.0, result={"n": 1}, chain=chain
    )

    assert sealed and nxt is not None and nxt.id == second
    done = get_run(conn, first)
    assert done["status"] == "succeeded" and done["result"] == {"n": 1}
    assert done["lease_owner"] is None and done["finished_at"] is not None
    assert [h["outcome"] for h in done["history"]] == ["succeeded"]
    running = get_run(conn, second)
    assert running["status"] == "running" and running["lease_owner"] == nxt.owner
    assert running["attempts"] == 1 and nxt.payload == {"i": 1}


def test_nothing_to_claim_still_seals(conn: Conn, chain: lease.Chain | None) -> None:
    (only,) = enqueue(conn, 1)
    claim = claim_one(conn)
    assert lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain) == (
        True,
        None,
    )
    assert get_run(conn, only)["status"] == "succeeded"


def test_a_stale_owner_seals_nothing_but_the_claim_proceeds(
    conn: Conn, dsn: str, chain: lease.Chain | None
) -> None:
    first, second = enqueue(conn, 2)
    stale = claim_one(conn)
    expire_lease(conn, first)
    with psycopg.connect(dsn, autocommit=True) as other:
        thief = claim_one(other)
    assert thief.id == first

    sealed, nxt = lease.finish_and_claim(conn, stale, ["k"], worker="w1", lease=30.0, chain=chain)

    assert not sealed
    assert nxt is not None and nxt.id == second
    stolen = get_run(conn, first)
    assert stolen["status"] == "running" and stolen["lease_owner"] == thief.owner


def test_the_run_being_sealed_is_never_reclaimed_by_the_same_statement(
    conn: Conn, chain: lease.Chain | None
) -> None:
    (only,) = enqueue(conn, 1)
    claim = claim_one(conn)
    expire_lease(conn, only)  # still ours (nobody took it), and claimable by the expired branch

    sealed, nxt = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)

    assert sealed and nxt is None
    run = get_run(conn, only)
    assert run["status"] == "succeeded" and run["attempts"] == 1


def test_it_commits_synchronously_as_a_claim_alone_does(
    conn: Conn, chain: lease.Chain | None
) -> None:
    # A claim lost in a server crash would be handed out again while its first worker's
    # handler may still run it: every claim commits synchronously.
    enqueue(conn, 3)
    with conn.transaction():
        claim = claim_one(conn)
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
    with conn.transaction():
        lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)


def test_a_tenanted_run_due_is_claimed_as_the_whole_statement_would(conn: Conn) -> None:
    # The quick statement must not take the untenanted run when a tenanted one comes first:
    # it seals, claims nothing, and the claim is made with the whole statement.
    first, second = enqueue(conn, 2)
    app = App()
    app.task("k")(lambda ctx, p: None)
    urgent = app.enqueue(conn, "k", {}, tenant="acme", priority=-1)
    claim = claim_one(conn)
    assert claim.id == urgent
    lease.finish(conn, claim, "succeeded")
    claim = claim_one(conn)
    assert claim.id == first
    later = app.enqueue(conn, "k", {}, tenant="acme", priority=-1)
    chain = lease.Chain(recheck=60.0)

    sealed, nxt = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)

    assert sealed and nxt is not None and nxt.id == later and nxt.tenant == "acme"
    assert get_run(conn, first)["status"] == "succeeded"
    assert get_run(conn, second)["status"] == "queued"
    assert not chain.quick(claim.sent)  # the whole statement until the recheck


def test_a_tenanted_run_whose_lease_expired_is_reclaimed_as_the_whole_statement_would(
    conn: Conn,
) -> None:
    app = App()
    app.task("k")(lambda ctx, p: None)
    dead = app.enqueue(conn, "k", {}, tenant="acme", priority=-1)
    first, _ = enqueue(conn, 2)
    assert claim_one(conn).id == dead
    claim = claim_one(conn)
    assert claim.id == first
    expire_lease(conn, dead)  # its worker died

    sealed, nxt = lease.finish_and_claim(
        conn, claim, ["k"], worker="w1", lease=30.0, chain=lease.Chain()
    )

    assert sealed and nxt is not None and nxt.id == dead and nxt.attempts == 2


def test_a_lease_expired_without_a_tenant_is_reclaimed_as_the_whole_statement_would(
    conn: Conn,
) -> None:
    # The quick statement claims queued runs only: an expired lease (its worker died) comes
    # first by priority, so it seals, claims nothing, and the whole statement reclaims it.
    app = App()
    app.task("k")(lambda ctx, p: None)
    dead = app.enqueue(conn, "k", {}, priority=-1)
    first, second = enqueue(conn, 2)
    assert claim_one(conn).id == dead
    claim = claim_one(conn)
    assert claim.id == first
    expire_lease(conn, dead)
    chain = lease.Chain(recheck=60.0)

    sealed, nxt = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)

    assert sealed and nxt is not None and nxt.id == dead and nxt.attempts == 2
    assert [h["outcome"] for h in get_run(conn, dead)["history"]] == ["expired"]
    assert get_run(conn, first)["status"] == "succeeded"
    assert get_run(conn, second)["status"] == "queued"
    assert not chain.quick(claim.sent)


def test_a_lease_that_cannot_be_reclaimed_leaves_the_quick_statement_in_use(conn: Conn) -> None:
    # An expired run on its last attempt, or with a cancel requested, is settle's to end, not the
    # claim's: it must not send every job to the whole statement until then.
    app = App()
    app.task("k")(lambda ctx, p: None)
    spent = app.enqueue(conn, "k", {}, priority=-1, max_attempts=1)
    cancelled = app.enqueue(conn, "k", {}, priority=-1)
    _, second = enqueue(conn, 2)
    assert claim_one(conn).id == spent
    assert claim_one(conn).id == cancelled
    conn.execute("SELECT leasework.cancel(%s)", (cancelled,))
    expire_lease(conn, spent)
    expire_lease(conn, cancelled)
    claim = claim_one(conn)
    chain = lease.Chain()

    sealed, nxt = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)

    assert sealed and nxt is not None and nxt.id == second
    assert chain.quick(claim.sent)


def test_the_sealed_row_does_not_come_back_with_its_payload(conn: Conn) -> None:
    # The quick statement returns the sealed row too (to say it was sealed): not its payload
    # and result, which can be large and which the caller has read already.
    app = App()
    app.task("k")(lambda ctx, p: None)
    big = app.enqueue(conn, "k", {"blob": "x" * 100_000})
    following = app.enqueue(conn, "k", {"small": 1})
    claim = claim_one(conn)
    chain = lease.Chain()
    params = {
        "id": claim.id,
        "owner": claim.owner,
        "result": lease.encode_result({"r": "y" * 100_000}),
        "kinds": chain.kinds(["k"]),
        "worker": "w1",
        "lease": 30.0,
    }

    with conn.cursor() as cur:  # both forms, with both rows as they come back
        for text in (lease.FINISH_AND_CLAIM_QUEUED, lease.FINISH_AND_CLAIM_LEAN):
            with conn.transaction(force_rollback=True):
                rows = cur.execute(text, params).fetchall()
            (sealed,) = [r for r in rows if r[0]]
            (claimed,) = [r for r in rows if not r[0]]
            assert sealed[1] == big and claimed[1] == following
            payload, result = (
                1 + lease.CLAIM_COLUMNS.index("payload"),
                1 + lease.CLAIM_COLUMNS.index("result"),
            )
            assert sealed[payload] is None and sealed[result] is None
            assert claimed[payload] == {"small": 1}

    was_sealed, row = chain.quick_rows(conn, params)  # the claimed row alone

    assert was_sealed and row is not None
    assert row[0] == following and row[lease.CLAIM_COLUMNS.index("payload")] == {"small": 1}
    assert get_run(conn, big)["result"] == {"r": "y" * 100_000}


def test_a_seal_of_a_run_no_longer_ours_still_claims(conn: Conn, chain: lease.Chain | None) -> None:
    first, second = enqueue(conn, 2)
    claim = claim_one(conn)
    assert claim.id == first
    expire_lease(conn, first)
    stolen = claim_one(conn)  # another worker reclaimed it
    assert stolen.id == first and stolen.owner != claim.owner

    sealed, nxt = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)

    assert not sealed and nxt is not None and nxt.id == second
    run = get_run(conn, first)
    assert run["status"] == "running" and run["lease_owner"] == stolen.owner


def test_a_paused_kind_is_claimed_by_neither_statement(
    conn: Conn, chain: lease.Chain | None
) -> None:
    # Both statements leave a paused kind's runs and take the others' (each reads the kinds it
    # may take one by one, a paused one not at all); the quick one stays in use meanwhile.
    app = App()
    app.task("k")(lambda ctx, p: None)
    app.task("paused")(lambda ctx, p: None)
    first, *_ = enqueue(conn, 1)
    held = app.enqueue(conn, "paused", {}, priority=-1)
    later = app.enqueue(conn, "k", {})
    claim = claim_one(conn)
    assert claim.id == first
    conn.execute("INSERT INTO leasework.paused_kinds (kind) VALUES ('paused')")

    sealed, nxt = lease.finish_and_claim(
        conn, claim, ["k", "paused"], worker="w1", lease=30.0, chain=chain
    )

    assert sealed and nxt is not None and nxt.id == later
    assert get_run(conn, held)["status"] == "queued"
    if chain is not None:
        assert chain.quick(claim.sent)  # a pause does not cost the quick statement


def test_tenanted_runs_not_due_leave_the_quick_statement_in_use(conn: Conn) -> None:
    _, second = enqueue(conn, 2)
    app = App()
    app.task("k")(lambda ctx, p: None)
    app.task("other")(lambda ctx, p: None)
    app.enqueue(conn, "other", {}, tenant="acme", priority=-1)  # not a kind polled here
    app.enqueue(conn, "k", {}, tenant="acme", priority=-1, delay=3600)  # not due yet
    claim = claim_one(conn)
    chain = lease.Chain()

    sealed, nxt = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)

    assert sealed and nxt is not None and nxt.id == second
    assert chain.quick(claim.sent)


def test_the_lean_form_leaves_a_tenanted_run_due_to_the_next_probe(conn: Conn) -> None:
    # Within its lean window the chain does not ask about tenanted runs: the untenanted one is
    # taken. The window is short (lease.PROBE_EVERY); once it is over, the probed statement
    # sees the tenanted run and the whole claim takes it.
    first, second, third = enqueue(conn, 3)
    app = App()
    app.task("k")(lambda ctx, p: None)
    claim = claim_one(conn)
    assert claim.id == first
    urgent = app.enqueue(conn, "k", {}, tenant="acme", priority=-1)
    chain = lean_chain()

    sealed, nxt = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)

    assert sealed and nxt is not None and nxt.id == second
    chain.lean_until = float("-inf")  # the window is over
    sealed, nxt = lease.finish_and_claim(conn, nxt, ["k"], worker="w1", lease=30.0, chain=chain)
    assert sealed and nxt is not None and nxt.id == urgent
    assert get_run(conn, third)["status"] == "queued"
    assert not chain.quick(claim.sent)


def test_the_quick_claim_starts_after_the_sealed_run_and_its_probe_sees_what_lands_before(
    conn: Conn,
) -> None:
    # The quick claim's range starts after the sealed run (what lies before it was claimed with
    # it; under a snapshot held elsewhere its dead index entries would be walked again by every
    # claim). A run that lands before the sealed one later (here: queued again with its old
    # queued_at, as a release does) is passed over by the lean form, and the probed form's gate
    # sees it, so the whole claim takes it: it waits at most lease.PROBE_EVERY.
    first, second, third, fourth = enqueue(conn, 4)
    assert claim_one(conn).id == first
    claim = claim_one(conn)
    assert claim.id == second
    conn.execute(  # the first run back in the queue, as the supervisor's release leaves it
        "UPDATE leasework.runs SET status = 'queued', lease_owner = NULL, lease_worker = NULL,"
        " lease_expires_at = NULL, started_at = NULL WHERE id = %s",
        (first,),
    )
    chain = lean_chain()

    sealed, nxt = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)

    assert sealed and nxt is not None and nxt.id == third
    chain.lean_until = float("-inf")  # the window is over
    sealed, nxt = lease.finish_and_claim(conn, nxt, ["k"], worker="w1", lease=30.0, chain=chain)
    assert sealed and nxt is not None and nxt.id == first
    assert get_run(conn, fourth)["status"] == "queued"
    assert not chain.quick(claim.sent)


@pytest.mark.parametrize("what", ["tenanted", "expired"])
def test_a_lean_form_that_claims_nothing_claims_with_claim_runs_at_once(
    conn: Conn, what: str
) -> None:
    # No untenanted run left: the lean form claims nothing, and the worker would rest with a
    # tenanted run due or a lease to reclaim. claim_runs takes it in the same call, and the
    # chain sends the whole statement until its recheck.
    app = App()
    app.task("k")(lambda ctx, p: None)
    (first,) = enqueue(conn, 1)
    if what == "tenanted":
        other = app.enqueue(conn, "k", {}, tenant="acme", priority=1)
        claim = claim_one(conn)
    else:
        other = app.enqueue(conn, "k", {}, priority=-1)
        assert claim_one(conn).id == other
        claim = claim_one(conn)
        expire_lease(conn, other)
    assert claim.id == first
    chain = lean_chain()

    sealed, nxt = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)

    assert sealed and nxt is not None and nxt.id == other
    assert not chain.quick(claim.sent) and chain.probed(claim.sent)


def test_the_quick_statement_is_lean_until_probe_every_after_a_probe_found_nothing(
    conn: Conn,
) -> None:
    _, second, _ = enqueue(conn, 3)
    claim = claim_one(conn)
    chain = lease.Chain(probe_every=5.0)
    assert chain.probed(claim.sent)

    sealed, nxt = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)

    assert sealed and nxt is not None and nxt.id == second
    assert not chain.probed(nxt.sent) and not chain.probed(nxt.sent + 4.9)
    assert chain.probed(nxt.sent + 5.0)


def test_a_queue_that_ran_dry_leaves_the_quick_statement_in_use(conn: Conn) -> None:
    # Nothing left for the quick statement nor for claim_runs: nothing only the whole statement
    # takes is queued, so the next job's seal is the quick one again, probed (what was enqueued
    # since is unknown).
    enqueue(conn, 1)
    claim = claim_one(conn)
    chain = lease.Chain()

    assert lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain) == (
        True,
        None,
    )
    assert chain.quick(claim.sent) and chain.probed(claim.sent)


def _queued_before_the_others(conn: Conn, hours: int) -> int:
    """A run queued `hours` before now: before every run enqueued in the test so far."""
    (run,) = enqueue(conn, 1)
    conn.execute(
        "UPDATE leasework.runs SET queued_at = queued_at - make_interval(hours => %s)"
        " WHERE id = %s",
        (hours, run),
    )
    return run


def test_a_miss_of_a_run_the_quick_statement_takes_too_is_forgiven_once_per_recheck(
    conn: Conn,
) -> None:
    # The probed quick statement claims nothing when a run lies before the one it seals (here,
    # one whose queued_at is earlier; in a worker, a rival's claim in flight that its snapshot
    # saw as queued), and claim_runs takes it: a run without a tenant, at its first attempt,
    # which the quick statement takes too. That says nothing of the queue: the quick statement
    # again from the next job, not the whole one for `recheck`. A second miss within the
    # recheck keeps the whole statement, as any other claim_runs take does.
    enqueue(conn, 1)
    claim = claim_one(conn)
    early = _queued_before_the_others(conn, 1)
    chain = lease.Chain(recheck=60.0)

    sealed, nxt = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)

    assert sealed and nxt is not None and nxt.id == early and nxt.attempts == 1
    assert chain.quick(nxt.sent)  # forgiven: the quick statement again

    earlier = _queued_before_the_others(conn, 2)
    sealed, again = lease.finish_and_claim(conn, nxt, ["k"], worker="w1", lease=30.0, chain=chain)

    assert sealed and again is not None and again.id == earlier
    assert not chain.quick(again.sent)  # a second miss within the recheck: the whole statement
    assert get_run(conn, early)["status"] == "succeeded"


def test_a_miss_is_forgiven_again_once_its_recheck_has_passed() -> None:
    chain = lease.Chain(recheck=5.0)
    chain.claimed_nothing(100.0)
    chain.missed(100.0)
    assert chain.quick(100.0)
    chain.claimed_nothing(101.0)
    chain.missed(101.0)  # within the recheck of the last forgiven miss
    assert not chain.quick(105.9) and chain.quick(106.0)
    chain.claimed_nothing(106.0)
    chain.missed(106.0)  # past it
    assert chain.quick(106.0)


def test_the_chain_sends_the_quick_statement_again_after_its_recheck() -> None:
    chain = lease.Chain(recheck=5.0)
    assert chain.quick(100.0)
    chain.claimed_nothing(100.0)
    assert not chain.quick(104.9)
    assert chain.quick(105.0)


def test_a_run_with_a_tenant_is_sealed_with_the_next_claim(
    conn: Conn, chain: lease.Chain | None
) -> None:
    app = App()
    app.task("k")(lambda ctx, p: None)
    first = app.enqueue(conn, "k", {}, tenant="acme")
    second = app.enqueue(conn, "k", {}, tenant="globex")
    claim = claim_one(conn)
    assert claim.id == first

    sealed, nxt = lease.finish_and_claim(
        conn, claim, ["k"], worker="w1", lease=30.0, result={"ok": 1}, chain=chain
    )

    assert sealed and nxt is not None and nxt.id == second and nxt.tenant == "globex"
    run = get_run(conn, first)
    assert run["status"] == "succeeded" and run["result"] == {"ok": 1}


@pytest.mark.parametrize("rule", ["group", "exclusive"])
def test_the_next_run_the_limiter_held_back_for_the_sealed_one_is_claimed_once_it_is_sealed(
    conn: Conn, chain: lease.Chain | None, rule: str
) -> None:
    # The statement's claim still sees the run it seals as holding its lease: its limiter is
    # stricter than after the seal, so the same tenant's next run of the same group (or any, the
    # sealed one being exclusive) is not claimed there. finish_and_claim claims it on its own
    # once the seal has committed: never both running, and the worker does not rest with it due.
    app = App()
    app.task("k")(lambda ctx, p: None)
    options: dict[str, Any] = {"group": "g"} if rule == "group" else {"exclusive": True}
    first = app.enqueue(conn, "k", {}, tenant="acme", **options)
    second = app.enqueue(conn, "k", {}, tenant="acme", **options)
    claim = claim_one(conn)
    assert claim.id == first
    assert lease.claim_runs(conn, ["k"], worker="w2", lease=30.0) == []  # the limiter holds

    sealed, nxt = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)

    assert sealed and nxt is not None and nxt.id == second
    assert get_run(conn, first)["status"] == "succeeded"


def test_sealing_a_tenanted_run_does_not_loosen_the_limiter_for_another_runs_lease(
    conn: Conn, chain: lease.Chain | None
) -> None:
    # Another worker holds a run of acme's group g; the run sealed is acme's too (group h). The
    # next run, acme's group g again, must wait for the other worker's run, not ride on the seal.
    app = App()
    app.task("k")(lambda ctx, p: None)
    held = app.enqueue(conn, "k", {}, tenant="acme", group="g")
    first = app.enqueue(conn, "k", {}, tenant="acme", group="h")
    blocked = app.enqueue(conn, "k", {}, tenant="acme", group="g")
    assert lease.claim_runs(conn, ["k"], worker="w2", lease=30.0)[0].id == held
    claim = claim_one(conn)
    assert claim.id == first

    sealed, nxt = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)

    assert sealed and nxt is None
    assert get_run(conn, blocked)["status"] == "queued"
    assert get_run(conn, held)["status"] == "running"


class Spy:
    """Counts the separate finishes the runs stage makes (the real function still runs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.finishes = 0
        real = lease.finish

        def counted(*args: Any, **kwargs: Any) -> bool:
            self.finishes += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(lease, "finish", counted)


def test_the_runs_stage_seals_each_success_with_the_next_claim(
    conn: Conn, make_worker: MakeWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = App()

    @app.task("k")
    def k(ctx: Context, payload: Any) -> dict[str, Any]:
        return {"got": payload["i"]}

    ids = [app.enqueue(conn, "k", {"i": i}) for i in range(5)]
    spy = Spy(monkeypatch)
    worker = make_worker(app)

    assert worker.poll() == 5

    assert spy.finishes == 0  # every seal rode on a claim (the last on the one that found none)
    for i, run_id in enumerate(ids):
        run = get_run(conn, run_id)
        assert run["status"] == "succeeded" and run["result"] == {"got": i}
        assert [h["outcome"] for h in run["history"]] == ["succeeded"]


def test_runs_with_a_tenant_are_sealed_with_the_next_claim_too(
    conn: Conn, make_worker: MakeWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = App()
    app.task("k")(lambda ctx, p: None)
    ids = [app.enqueue(conn, "k", {}, tenant="t0" if i < 4 else "t1", group="g") for i in range(6)]
    spy = Spy(monkeypatch)

    # One poll takes all six, although each run's successor in its tenant and group could only
    # be claimed once the run before was sealed (t0's four: the statement's claim holds each
    # back, and finish_and_claim claims it after the seal).
    assert make_worker(app).poll() == 6

    assert spy.finishes == 0
    assert {get_run(conn, i)["status"] for i in ids} == {"succeeded"}


def test_a_worker_told_to_stop_seals_its_last_success_and_claims_no_more(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    worker_box: list[Worker] = []

    @app.task("k")
    def k(ctx: Context, payload: Any) -> None:
        worker_box[0].drain()

    first, second = (app.enqueue(conn, "k", {}) for _ in range(2))
    worker = make_worker(app)
    worker_box.append(worker)

    assert worker.poll() == 1

    assert get_run(conn, first)["status"] == "succeeded"
    assert get_run(conn, second)["status"] == "queued"


def test_a_result_that_cannot_be_stored_fails_the_run_with_a_clear_error(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()

    @app.task("k", max_attempts=1)
    def k(ctx: Context, payload: Any) -> object:
        return object()

    run_id = app.enqueue(conn, "k", {})
    make_worker(app).poll()

    run = get_run(conn, run_id)
    assert run["status"] == "failed"
    assert "result is not JSON-serializable" in run["error"]
    assert run["lease_owner"] is None


def test_an_unstorable_result_gathered_before_a_failure_does_not_lose_the_failure(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()

    @app.task("k", max_attempts=1)
    def k(ctx: Context, payload: Any) -> None:
        ctx.result = {"bad": {1, 2}}  # a set: not JSON
        raise RuntimeError("upstream said no")

    run_id = app.enqueue(conn, "k", {})
    make_worker(app).poll()

    run = get_run(conn, run_id)
    assert run["status"] == "failed" and "upstream said no" in run["error"]
    assert run["result"] is None


def test_a_beat_between_runs_lets_a_child_recycle_after_exactly_its_jobs(
    conn: Conn, dsn: str
) -> None:
    app = App()
    app.task("k")(lambda ctx, p: None)  # never calls ctx.check(), so never beats on its own
    ids = [app.enqueue(conn, "k", {}) for _ in range(5)]

    def recycle_after_two(worker: Worker, ctx: Context | None) -> None:
        if worker.jobs_done >= 2 and not worker.stopping:  # as the supervisor's child does
            worker.drain()

    cfg = fast_config(dsn)
    worker = Worker(app.with_config(cfg), cfg, on_beat=recycle_after_two)
    with worker:
        worker.running = True
        assert worker.poll() == 2

    assert [get_run(conn, i)["status"] for i in ids] == ["succeeded"] * 2 + ["queued"] * 3


# -- the quick statement through libpq (Chain.quick_rows) ------------------------------------------


def seal_next(conn: Conn, claim: lease.Claim, chain: lease.Chain) -> lease.Claim | None:
    sealed, nxt = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)
    assert sealed
    return nxt


def test_a_prepared_statement_the_server_forgot_is_prepared_again(conn: Conn) -> None:
    ids = enqueue(conn, 3)
    chain = lease.Chain()
    claim = seal_next(conn, claim_one(conn), chain)
    assert claim is not None and claim.id == ids[1]
    conn.execute("DEALLOCATE ALL")  # what a pooler's or an operator's reset does

    nxt = seal_next(conn, claim, chain)

    assert nxt is not None and nxt.id == ids[2]


def test_a_new_chain_on_the_same_connection_prepares_its_own(conn: Conn) -> None:
    ids = enqueue(conn, 3)
    claim = seal_next(conn, claim_one(conn), lease.Chain())
    assert claim is not None

    nxt = seal_next(conn, claim, lease.Chain())  # the name is taken on this session already

    assert nxt is not None and nxt.id == ids[2]


def test_an_error_is_psycopgs_and_leaves_the_connection_usable(conn: Conn) -> None:
    enqueue(conn, 2)
    claim = claim_one(conn)
    chain = lease.Chain()
    params = {
        "id": claim.id,
        "owner": claim.owner,
        "result": None,
        "kinds": "{unclosed",
        "worker": "w1",
        "lease": 30.0,
    }

    with pytest.raises(psycopg.errors.InvalidTextRepresentation):
        chain.quick_rows(conn, params)

    assert get_run(conn, claim.id)["status"] == "running"  # nothing written
    assert seal_next(conn, claim, chain) is not None


def test_a_lost_connection_raises_operational_error_and_reads_as_closed(
    dsn: str, conn: Conn
) -> None:
    enqueue(conn, 2)
    with psycopg.connect(dsn, autocommit=True) as worker_conn:
        claim = claim_one(worker_conn)
        chain = lease.Chain()
        conn.execute("SELECT pg_terminate_backend(%s)", (worker_conn.info.backend_pid,))
        with pytest.raises(psycopg.OperationalError):
            lease.finish_and_claim(worker_conn, claim, ["k"], worker="w1", lease=30.0, chain=chain)
        assert worker_conn.closed
    assert get_run(conn, claim.id)["status"] == "running"  # a lost seal is reclaimed later


def test_a_notify_that_arrives_during_the_statement_is_still_read(dsn: str, conn: Conn) -> None:
    enqueue(conn, 2)
    with psycopg.connect(dsn, autocommit=True) as listening:
        listening.execute("LISTEN leasework_test_quick")
        claim = claim_one(listening)
        conn.execute("NOTIFY leasework_test_quick, 'before'")
        seal_next(listening, claim, lease.Chain())  # reads the NOTIFY with its answer

        payloads = [n.payload for n in listening.notifies(timeout=1.0, stop_after=1)]

    assert payloads == ["before"]


def test_inside_a_transaction_the_statement_goes_through_the_cursor(dsn: str, conn: Conn) -> None:
    first, second = enqueue(conn, 2)
    with psycopg.connect(dsn) as in_tx:  # not autocommit: finish_and_claim opens a transaction
        claim = claim_one(in_tx)
        in_tx.commit()
        chain = lease.Chain()

        nxt = seal_next(in_tx, claim, chain)

        assert nxt is not None and nxt.id == second
        assert in_tx.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert get_run(conn, first)["status"] == "succeeded"
    assert get_run(conn, second)["status"] == "running"


def test_the_quick_statement_claims_the_same_values_as_the_whole_one(conn: Conn) -> None:
    # Its rows come back in binary through libpq, the whole statement's in text through the
    # cursor: every field of the claim must load to the same value and type either way.
    app = App()
    app.task("k")(lambda ctx, p: None)
    ids = [
        app.enqueue(conn, "k", {"i": i, "s": "é"}, max_attempts=5, key=f"key-{i}", priority=2)
        for i in range(3)
    ]
    conn.execute("UPDATE leasework.runs SET lease_seconds = 45.5, total_units = 7")
    claim = claim_one(conn)
    _, by_whole = lease.finish_and_claim(conn, claim, ["k"], worker="w1", lease=30.0)
    assert by_whole is not None and by_whole.id == ids[1]
    _, by_quick = lease.finish_and_claim(
        conn, by_whole, ["k"], worker="w1", lease=30.0, chain=lease.Chain()
    )
    assert by_quick is not None and by_quick.id == ids[2]

    for name in lease.CLAIM_COLUMNS:
        field = "owner" if name == "lease_owner" else name
        whole, quick = getattr(by_whole, field), getattr(by_quick, field)
        assert type(whole) is type(quick), field
    assert by_quick.payload == {"i": 2, "s": "é"} and by_quick.key == "key-2"
    assert by_quick.lease_seconds == 45.5 and by_quick.total_units == 7
    assert by_quick.max_attempts == 5 and by_quick.attempts == 1


def test_text_goes_in_the_connections_client_encoding(dsn: str, conn: Conn) -> None:
    # The quick statement's parameters are sent as bytes by leasework itself, not by psycopg:
    # in the client encoding of the connection, whatever it is.
    app = App()
    app.task("k")(lambda ctx, p: None)
    first = app.enqueue(conn, "k", {})
    second = app.enqueue(conn, "k", {})
    with psycopg.connect(dsn, autocommit=True, client_encoding="LATIN1") as latin:
        claim = claim_one(latin)
        assert claim.id == first
        sealed, nxt = lease.finish_and_claim(
            latin, claim, ["k"], worker="wé", lease=30.0, result={"r": "é"}, chain=lease.Chain()
        )
    assert sealed and nxt is not None and nxt.id == second
    assert get_run(conn, first)["result"] == {"r": "é"}
    assert get_run(conn, second)["lease_worker"] == "wé"
