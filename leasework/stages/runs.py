"""The `runs` stage: claim and execute up to `limit` runs of the app's task kinds, one at a time,
inline (a kind declared with batch=N: up to `limit` batches of N, claimed in one statement each,
still executed one at a time), and more while no other stage is due; then settle expired and
waiting runs. A success is sealed in the same statement as the next claim (lease.sql,
finish_and_claim)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .. import log, operations
from ..config import Range, doc, section
from ..leases import lease
from ..leases.lease import Claim
from ..tasks import Registry
from ..workers import idle
from ..workers.stage import Site


@section("The `runs` stage", order=10)
@dataclass(frozen=True)
class RunsSettings:
    runs_limit: int = field(
        default=10,
        metadata=doc(
            "runs the `runs` stage executes per poll before it yields to another stage that is due "
            "(it goes on while every other stage rests)",
            range=Range(1, 1000),
        ),
    )
    settle_limit: int = field(
        default=100,
        metadata=doc("expired or waiting runs settled per poll at most", range=Range(1, 100_000)),
    )


class RunsStage:
    name = "runs"
    settings = RunsSettings

    def __init__(self, app: Registry, *, limit: int = 10, settle_limit: int = 100) -> None:
        self.app = app
        self.limit = limit
        self.settle_limit = settle_limit
        self._settled_at = float("-inf")  # monotonic time of the last expire_and_promote
        # What the last step that ran dry saw: seconds until a run of its kinds is next due
        # (None: none), and the monotonic time it was read; None if the last step did not ask.
        self._due: idle.Seen = None
        # The sessions whose open enqueue kept a waiting run from its promotion at the last
        # settle: each is logged once while it lasts.
        self._busy: set[int] = set()
        self._declared = False  # its kinds' limits written (declare_limits), before any claim

    @property
    def wakes(self) -> list[str]:
        """An enqueue NOTIFYs its kind: the kinds this stage runs."""
        return self.app.kinds(stage=self.name)

    def step(self, site: Site) -> int:
        # Only the kinds of this worker's pool (config `pools`), for every claim below: the
        # claim on its own, the one riding on a seal, and a batch's (whose kind is one of these).
        kinds = site.claimable(self.app.kinds(stage=self.name))
        self._due = None
        if not self._declared:
            declare_limits(site, self.app, self.name)
            self._declared = True
        # Claim and settle on the main connection: idle between runs, it spares a pool
        # check-out per claim and keeps the claim's generic plan (Connections.main).
        handled = 0
        # A one-at-a-time success whose seal rides on the next claim (finish_and_claim: one
        # round trip and one commit per job instead of two). Sealed on its own when there is no
        # next claim to make: the step ending, the worker stopping, or an error.
        pending: tuple[Claim, Any] | None = None
        turns = 0
        drained = False  # the last claim found nothing
        # A stage of one kind declared batch=N claims its N in one statement (with several
        # kinds the first run is claimed across all of them, so priority decides which kind).
        whole = self.app.tasks[kinds[0]].batch if len(kinds) == 1 else 1
        try:
            while not site.stopping:
                if turns >= self.limit:
                    # This stage's share of a poll. Another stage due ends the step; while every
                    # other stage rests, the chain goes on: ending the step here would cost a seal
                    # and a claim of their own (two commits) where the next claim carries the seal.
                    site.conns.wake.drain_notifies()
                    if site.yield_after_limit(self.name):
                        break
                    turns = 0
                turns += 1
                claims: list[Claim] | None = None
                if pending is not None:
                    claims = site.executor.completer.seal_and_claim(pending, kinds)
                    pending = None
                if claims is None:
                    if pending is not None:
                        site.executor.completer.seal_success(*pending)
                        pending = None
                    # Through the chain's own prepared statement (libpq): a woken idle
                    # worker's first round trip is this claim (pickup latency).
                    claims = lease.claim_runs(
                        site.conns.main(),
                        kinds,
                        worker=site.worker_id,
                        lease=site.config.lease,
                        limit=whole,
                        chain=site.executor.completer.chain,
                    )
                if not claims:
                    drained = True
                    break
                first = claims[0]
                handler = self.app.handler(first.kind)
                batch = self.app.tasks[first.kind].batch
                if batch == 1:
                    done: list[tuple[Claim, Any]] = []
                    site.executor.run(first, handler, defer=done)
                    pending = done[0] if done else None
                    handled += 1
                    # Between two runs: liveness, and the supervisor's child recycles after
                    # exactly max_jobs_per_child runs (it drains the worker from this beat).
                    site.executor.beat(None)
                    continue
                # A kind with batch=N: the next N - 1 runs of the same kind in one more statement,
                # so that which run comes first still follows priority across every kind.
                if whole == 1:
                    claims += lease.claim_runs(
                        site.conns.main(),
                        [first.kind],
                        worker=site.worker_id,
                        lease=site.config.lease,
                        limit=batch - 1,
                    )
                handled += site.executor.run_batch(claims, handler)
        finally:
            if pending is not None:
                site.executor.completer.seal_success(*pending)
        # Settle after claiming, so that a worker woken by a NOTIFY spends its first round trip
        # on the claim (pickup latency); when the queue ran dry, and otherwise at most once per
        # poll_interval (the period an idle worker polls at: expired leases with no attempt left
        # and waiting runs need no quicker turn while the queue keeps the worker busy, and a
        # statement per step would be a commit every `limit` jobs). What settle promotes counts
        # as work, so the worker polls again at once and claims it then.
        # Dry, it also reads when a run of its kinds is next due (`next_due`: how long an idle
        # worker may sleep), in the settle's transaction: one commit for both.
        now = time.monotonic()
        if not drained and now - self._settled_at < site.config.poll_interval:
            return handled
        self._settled_at = now
        conn = site.conns.main()
        busy: list[int] = []
        if not drained:
            ended, promoted = lease.expire_and_promote(conn, self.settle_limit, busy)
        else:
            with conn.transaction():
                ended, promoted = lease.expire_and_promote(conn, self.settle_limit, busy)
                self._due = lease.next_due(conn, kinds), time.monotonic()
        self._note_busy(busy)
        return handled + ended + promoted

    def _note_busy(self, busy: list[int]) -> None:
        """Log, once each, the sessions whose open enqueue of a key kept its waiting run from
        being promoted (tried again at every settle until they end)."""
        fresh = sorted(set(busy) - self._busy)
        if fresh:
            log.event(
                "promotion_skipped",
                level=30,
                reason="key held by an open enqueue",
                blocking_pids=fresh,
            )
        self._busy = set(busy)

    def next_due(self, site: Site) -> float | None:
        """Seconds until a run of its kinds is next due (a delayed or retried run, a lease that
        runs out), as the last step read it; 0 (unknown) if it did not (workers/stage.py, Due)."""
        return idle.due_now(self._due, time.monotonic())


def declare_limits(site: Site, app: Registry, stage: str) -> None:
    """Record the limits the app declares for the kinds `stage` runs (`@app.task(kind,
    max_running=, group_limit=, rate=, rate_per=)`; none for a kind without), before the
    stage's first claim: every host reads them from leasework.kind_limits, so the fleet holds
    the same ones whatever version each worker runs (the last to start wins; an operator's
    `leasework limits set` wins over both until reset)."""
    declared = {kind: dict(app.tasks[kind].limits) for kind in app.kinds(stage=stage)}
    changed = operations.declare_limits(site.conns.main(), declared)
    if changed:
        log.event("limits_declared", kinds=changed)
