"""A hypothesis state machine over the lease against the real database: enqueue, claim, renew,
checkpoint, finish, fail (requeue), release, cancel, settle, fence, advance the database clock,
crash (forget a claim) and wake a crashed worker (use its stale token). After every step: at most
one live owner per run, a stale token writes nothing, attempts stay within max_attempts, terminal
states are final, no run is lost, and the limiter holds. At the end every run must drain to a
terminal state."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from psycopg.rows import dict_row

from leasework.leases import lease
from leasework.leases.lease import Claim

from ..conftest import shift_clock
from .checks import KINDS, LEASE, make_app

TERMINAL = {"succeeded", "partial", "failed", "cancelled"}
LIVE_CONFLICTS = """
SELECT a.id, b.id
  FROM leasework.runs a
  JOIN leasework.runs b ON a.tenant = b.tenant AND a.id < b.id
 WHERE a.status = 'running' AND b.status = 'running'
   AND a.lease_expires_at >= leasework.now() AND b.lease_expires_at >= leasework.now()
   AND (a.exclusive OR b.exclusive OR a."group" = b."group")
"""


class LeaseMachine(RuleBasedStateMachine):
    dsn: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.conn: psycopg.Connection[Any] = psycopg.connect(self.dsn, autocommit=True)
        self.conn.execute("DELETE FROM leasework.runs")
        self.conn.execute("DELETE FROM leasework.tenants")
        self.offset = 0.0
        shift_clock(self.conn, 0)
        self.app = make_app()
        self.ids: list[int] = []
        self.claims: list[Claim] = []  # every claim ever issued
        self.held: list[Claim] = []  # claims a live worker still acts on (maybe stale)
        self.crashed: list[Claim] = []  # claims of workers that died (or paused)
        self.terminal: dict[int, tuple[str, datetime]] = {}
        self.workers = 0

    # -- helpers --------------------------------------------------------------------------------

    def row(self, run_id: int) -> dict[str, Any]:
        with self.conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute("SELECT * FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
        assert row is not None, f"run {run_id} was lost"
        return row

    def owns(self, claim: Claim) -> bool:
        row = self.row(claim.id)
        return row["status"] == "running" and row["lease_owner"] == claim.owner

    def note_terminal(self, run_id: int) -> None:
        row = self.row(run_id)
        if row["status"] in TERMINAL:
            self.terminal.setdefault(run_id, (row["status"], row["finished_at"]))

    def stale_write(self, claim: Claim, write: Any, *, live: bool = False) -> Any:
        """Perform a write with `claim`; if the claim is not the owner, it must change nothing.
        `live`: a renewal (renew, checkpoint) also needs the lease not to have run out: a lapsed
        lease is never revived, since the limiter may have let its tenant run another."""
        before = self.row(claim.id)
        mine = before["status"] == "running" and before["lease_owner"] == claim.owner
        if live and mine:
            with self.conn.cursor() as cur:
                now = cur.execute("SELECT leasework.now()").fetchone()
            assert now is not None
            mine = before["lease_expires_at"] > now[0]
        result = write()
        if not mine:
            assert not result, f"a stale token's write returned {result!r}"
            assert self.row(claim.id) == before, "a stale token's write changed the row"
        else:
            assert result, "the owner's write matched nothing"
        self.note_terminal(claim.id)
        return result

    # -- rules ----------------------------------------------------------------------------------

    @rule(
        key=st.sampled_from([None, "k1", "k2"]),
        tenant=st.sampled_from([None, "t1", "t2"]),
        group=st.sampled_from([None, "g1", "g2"]),
        exclusive=st.booleans(),
        max_attempts=st.integers(1, 3),
        delay=st.sampled_from([0, 0, 0, 30]),
    )
    def enqueue(
        self,
        key: str | None,
        tenant: str | None,
        group: str | None,
        exclusive: bool,
        max_attempts: int,
        delay: int,
    ) -> None:
        run_id = self.app.enqueue(
            self.conn,
            "job",
            {"n": len(self.ids)},
            key=key,
            tenant=tenant,
            group=group,
            exclusive=exclusive,
            max_attempts=max_attempts,
            delay=delay,
        )
        if run_id not in self.ids:
            self.ids.append(run_id)

    @rule(limit=st.integers(1, 3))
    def claim(self, limit: int) -> None:
        with self.conn.cursor(row_factory=dict_row) as cur:
            before = {
                r["id"]: r
                for r in cur.execute(
                    "SELECT *, leasework.now() AS db_now FROM leasework.runs"
                ).fetchall()
            }
        self.workers += 1
        claims = lease.claim_runs(
            self.conn, KINDS, worker=f"w{self.workers}", lease=LEASE, limit=limit
        )
        assert len(claims) <= limit
        known = {c.owner for c in self.claims}
        for c in claims:
            prior = before[c.id]
            was_free = prior["status"] == "queued" and prior["queued_at"] <= prior["db_now"]
            was_expired = (
                prior["status"] == "running"
                and prior["lease_expires_at"] < prior["db_now"]
                and prior["cancel_requested_at"] is None
            )
            assert was_free or was_expired, f"claimed run {c.id} from {prior['status']}"
            assert c.attempts == prior["attempts"] + 1 <= c.max_attempts
            assert c.owner not in known, "an owner token was reused"
            self.claims.append(c)
            self.held.append(c)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        claim = data.draw(st.sampled_from(self.held))
        self.stale_write(claim, lambda: lease.renew(self.conn, claim), live=True)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), processed=st.integers(0, 50))
    def checkpoint(self, data: st.DataObject, processed: int) -> None:
        claim = data.draw(st.sampled_from(self.held))
        self.stale_write(
            claim, lambda: lease.checkpoint(self.conn, claim, processed, 50), live=True
        )

    @precondition(lambda self: self.held)
    @rule(data=st.data(), status=st.sampled_from(["succeeded", "partial", "failed", "cancelled"]))
    def finish(self, data: st.DataObject, status: Any) -> None:
        claim = data.draw(st.sampled_from(self.held))
        self.stale_write(claim, lambda: lease.finish(self.conn, claim, status, result={"s": 1}))

    @precondition(lambda self: self.held)
    @rule(data=st.data(), delay=st.sampled_from([0, 5, 60]))
    def fail(self, data: st.DataObject, delay: int) -> None:
        claim = data.draw(st.sampled_from(self.held))
        before = self.row(claim.id)
        status = self.stale_write(
            claim, lambda: lease.requeue(self.conn, claim, delay=delay, error="boom")
        )
        if status is not None:
            if before["cancel_requested_at"] is not None:
                assert status == "cancelled"
            elif before["attempts"] >= before["max_attempts"]:
                assert status == "failed"
            else:
                assert status == "queued"

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        claim = data.draw(st.sampled_from(self.held))
        before = self.row(claim.id)
        if self.stale_write(claim, lambda: lease.release(self.conn, claim)) == "queued":
            assert self.row(claim.id)["attempts"] == before["attempts"] - 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def fence(self, data: st.DataObject) -> None:
        claim = data.draw(st.sampled_from(self.held))
        row = self.row(claim.id)
        with self.conn.transaction():
            now = lease.db_now(self.conn)
            fenced = lease.fence(self.conn, claim)
        live = self.owns(claim) and row["lease_expires_at"] > now
        assert fenced == live

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(self.ids))
        before = self.row(run_id)
        status = self.app.cancel(self.conn, run_id)
        if before["status"] in ("queued", "waiting"):
            assert status == "cancelled"
        elif before["status"] == "running":
            assert status == "running" and self.row(run_id)["cancel_requested_at"] is not None
        else:
            assert status == before["status"]
        self.note_terminal(run_id)

    @rule()
    def settle(self) -> None:
        lease.expire_and_promote(self.conn, 100)
        for run_id in self.ids:
            self.note_terminal(run_id)

    @rule(seconds=st.sampled_from([1, 10, 40, 119, 121, 300]))
    def advance_time(self, seconds: int) -> None:
        self.offset += seconds
        shift_clock(self.conn, self.offset)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        claim = data.draw(st.sampled_from(self.held))
        self.held.remove(claim)
        self.crashed.append(claim)

    @precondition(lambda self: self.crashed)
    @rule(data=st.data())
    def zombie_wakes(self, data: st.DataObject) -> None:
        """A worker we thought dead was only paused: it comes back and tries to finish."""
        claim = data.draw(st.sampled_from(self.crashed))
        self.stale_write(claim, lambda: lease.finish(self.conn, claim, "succeeded"))

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def nothing_lost_and_attempts_bounded(self) -> None:
        rows = self.conn.execute(
            "SELECT id, attempts, max_attempts, status FROM leasework.runs"
        ).fetchall()
        assert {r[0] for r in rows} == set(self.ids), "a run was lost or appeared"
        for run_id, attempts, max_attempts, _ in rows:
            assert 0 <= attempts <= max_attempts, f"run {run_id}: {attempts}/{max_attempts}"

    @invariant()
    def terminal_states_are_final(self) -> None:
        for run_id, (status, finished_at) in self.terminal.items():
            row = self.row(run_id)
            assert (row["status"], row["finished_at"]) == (status, finished_at)
            assert row["lease_owner"] is None

    @invariant()
    def at_most_one_live_owner(self) -> None:
        rows = self.conn.execute(
            "SELECT id, lease_owner FROM leasework.runs WHERE status = 'running'"
        ).fetchall()
        issued: dict[Any, int] = {}
        for c in self.claims:
            issued[c.owner] = issued.get(c.owner, 0) + 1
        for run_id, owner in rows:
            assert issued.get(owner) == 1, f"run {run_id} is owned by a token never issued once"
            owners = [c for c in self.claims if c.id == run_id and c.owner == owner]
            assert len(owners) == 1
            # and that owner is the latest claim of the run
            latest = [c for c in self.claims if c.id == run_id][-1]
            assert latest.owner == owner

    @invariant()
    def limiter_holds(self) -> None:
        assert self.conn.execute(LIVE_CONFLICTS).fetchall() == []

    def teardown(self) -> None:
        try:
            self.drain()
        finally:
            self.conn.close()

    def drain(self) -> None:
        """No run is lost: with time moved far ahead, every run reaches a terminal state."""
        shift_clock(self.conn, self.offset + 100_000)
        for _ in range(200):
            lease.expire_and_promote(self.conn, 100)
            claims = lease.claim_runs(self.conn, KINDS, worker="drain", lease=LEASE, limit=10)
            for c in claims:
                assert lease.finish(self.conn, c, "succeeded")
            left = self.conn.execute(
                "SELECT count(*) FROM leasework.runs WHERE status NOT IN"
                " ('succeeded', 'partial', 'failed', 'cancelled')"
            ).fetchone()
            assert left is not None
            if left[0] == 0:
                return
            if not claims:
                # Nothing claimable now: make live leases lapse too.
                self.offset += 100_000
                shift_clock(self.conn, self.offset + 100_000)
        raise AssertionError("runs never reached a terminal state")


def run_machine(dsn: str, max_examples: int = 30, steps: int = 30) -> None:
    machine = type("BoundLeaseMachine", (LeaseMachine,), {"dsn": dsn})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        ),
    )


def test_lease_state_machine(dsn: str, conn: psycopg.Connection[Any]) -> None:
    run_machine(dsn)
