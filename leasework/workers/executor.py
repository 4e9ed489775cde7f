"""The one place a claimed run is run: user tasks, syncs and ingest alike, one at a time or a
batch's in turn. The handler runs inline under the claim's lease (kept by the keeper, whatever the
handler does); its end is handed to the completer (workers/completer.py), which decides what it
means and writes it."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from .. import log, tracing
from ..config import Config
from ..errors import Snooze
from ..leases.lease import Claim
from ..queries import load
from .completer import Completer, Done
from .connections import Connections
from .context import Context
from .keeper import Keeper

Handler = Callable[[Context, Any], Any]
RUNS = load("leasework", "runs.sql")  # run_traceparent, read only by a worker that traces


def log_claimed(claim: Claim, worker_id: str) -> None:
    """The `run_claimed` event of a run about to start, at debug: a line per run at thousands of
    runs a second is a cost and noise (README, Watching it). Its fields are built only when
    DEBUG is on (once per run: one-at-a-time mode's hot path)."""
    if log.enabled(logging.DEBUG):
        log.event(
            "run_claimed",
            level=logging.DEBUG,
            run_id=claim.id,
            kind=claim.kind,
            attempt=claim.attempts,
            worker=worker_id,
        )


def traced_end(spans: tracing.RunSpans, span: Any, status: str | None, raised: Any) -> None:
    """The run span's end (tracing.RunSpans.ended): its outcome, the run's status after the
    attempt (`requeued` when queued again, `lost` when nothing was written); an error status
    when the attempt failed (a run failed or partial, or requeued after it raised, a Snooze
    aside)."""
    failed = status in ("failed", "partial") or (
        status == "queued" and isinstance(raised, Exception) and not isinstance(raised, Snooze)
    )
    outcome = {"queued": "requeued", None: "lost"}.get(status, status)
    spans.ended(span, str(outcome), raised, failed)


class Executor:
    def __init__(
        self,
        config: Config,
        *,
        worker_id: str,
        keeper: Keeper,
        conns: Connections,
        beat: Callable[[Context | None], None],
        stopping: Callable[[], bool],
        rand: random.Random | None = None,
    ) -> None:
        self.config = config
        self.worker_id = worker_id
        self.keeper = keeper
        self.conns = conns
        self.beat = beat
        self._stopping = stopping
        self.completer = Completer(config, worker_id=worker_id, conns=conns, rand=rand)
        self.current: Context | None = None
        self.sync_ended = 0.0  # monotonic time the last sync handler's run ended (aexecutor)
        self.jobs_done = 0
        log.install_record_factory()  # the handlers' records carry their run, for any handler

    def run(self, claim: Claim, handler: Handler, *, defer: list[Done] | None = None) -> str | None:
        """Run the handler under the claim's lease and have its end written (Completer.conclude,
        `defer` as there). Returns the run's new status, or None when the lease was lost and
        nothing was written. A batch's run is held already (Keeper.hold_many). With tracing on
        (docs/operations.md, "Tracing"), under the run's spans."""
        if tracing.AVAILABLE and tracing.enabled():
            return self._traced(claim, handler, defer)
        return self._run(claim, handler, defer, None)

    def _traced(self, claim: Claim, handler: Handler, defer: list[Done] | None) -> str | None:
        """`run` within the run's spans (tracing.RunSpans), under the trace of its enqueue."""
        (spans,) = self.run_spans([claim])
        with spans.run() as span:
            return self._run(claim, handler, defer, (spans, span))

    def run_spans(self, claims: Sequence[Claim]) -> list[tracing.RunSpans]:
        """The spans of each claimed run, under the trace of its enqueue: their traceparents are
        read here, one statement, paid only by a worker that traces."""
        try:
            rows = self.conns.main().execute(
                RUNS["run_traceparents"], {"ids": [c.id for c in claims]}
            ).fetchall()
        except psycopg.Error:  # the runs are still run, each in a trace of its own
            rows = []
        parents = {int(r[0]): r[1] for r in rows}
        return [
            tracing.RunSpans(
                parents.get(c.id),
                run_id=c.id,
                kind=c.kind,
                attempt=c.attempts,
                tenant=c.tenant,
                worker=self.worker_id,
                claim_sent=c.sent or time.monotonic(),
            )
            for c in claims
        ]

    def _run(
        self,
        claim: Claim,
        handler: Handler,
        defer: list[Done] | None,
        traced: tuple[tracing.RunSpans, Any] | None,
    ) -> str | None:
        returned: Any = None
        raised: BaseException | None = None
        fatal: BaseException | None = None  # KeyboardInterrupt, SystemExit: give the run back
        try:
            with self.keeper.holding(claim) as held:
                if held.signal.reason == "lost":
                    # The claim's answer came after its lease could have run out (Keeper.hold):
                    # another worker may hold the run now. Never start it.
                    log.event(
                        "claim_not_started", level=30, run_id=claim.id, owner=str(claim.owner)
                    )
                    return None
                ctx = Context(claim, self, held)
                self.current = ctx
                log_claimed(claim, self.worker_id)
                try:
                    self.beat(ctx)  # the supervisor knows the run before its handler starts
                    # The handler's own `logging` records carry the run (log.RUN, stamped on each
                    # record by log.install_record_factory).
                    token = log.RUN.set(
                        {"run_id": claim.id, "kind": claim.kind, "attempt": claim.attempts}
                    )
                    try:
                        ctx.interruptible = True
                        returned = handler(ctx, claim.payload)
                    finally:
                        ctx.interruptible = False
                        log.RUN.reset(token)
                except Exception as exc:
                    raised = exc
                except BaseException as exc:
                    ctx.signal.trip("shutdown")
                    raised = fatal = exc
            # No longer held: the keeper must not take the outcome's write for a lost lease.
            if traced is None:
                status = self.completer.conclude(ctx, returned, raised, defer=defer)
            else:
                spans, span = traced
                with spans.seal():
                    status = self.completer.conclude(ctx, returned, raised, defer=defer)
                traced_end(spans, span, status, raised)
            if fatal is not None:
                raise fatal
            return status
        finally:
            self.current = None
            self.sync_ended = time.monotonic()
            self.jobs_done += 1

    def run_batch(self, claims: Sequence[Claim], handler: Handler) -> int:
        """Run a batch claimed in one statement (a kind with batch=N): one run at a time, each
        under its own lease and context exactly as `run`; failures, retries, cancels and lost
        leases are written at once, successes together at the end.

        The keeper holds every lease of the batch from the claim on (runs not started yet are
        renewed with the running one). A run found no longer ours before it starts is skipped,
        one cancelled meanwhile ends `cancelled` unstarted. Runs not started when the worker
        stops are released (the attempt not charged). Returns how many runs were taken in hand."""
        done: list[Done] = []
        executed = 0
        completer, keeper, stopping = self.completer, self.keeper, self._stopping
        # Whether the runs are traced (`run` asks per run), asked once for the batch.
        traced = tracing.AVAILABLE and tracing.enabled()
        if claims:
            keeper.hold_many(claims, sent=min(c.sent for c in claims))
        written_at = time.monotonic()
        try:
            for i, claim in enumerate(claims):
                if stopping():
                    break
                executed = i + 1
                now = time.monotonic()
                if done:
                    renew = keeper.timing_of(claim.lease_seconds).renew
                    written_at = completer.seal_aging(done, written_at, now, renew)
                if keeper.due(now):  # renewals, control, shutdown before the next start
                    keeper.tend(now)
                held = keeper.get(claim.id)
                if held is not None and held.signal.tripped:
                    keeper.drop(claim.id)
                    completer.unstarted(held)
                    continue
                if traced:
                    self._traced(claim, handler, done)
                else:
                    self._run(claim, handler, done, None)
        finally:
            completer.seal_successes(done)
            unstarted = claims[executed:]
            completer.give_back(unstarted, "batch stopped before this run")
            for claim in unstarted:
                keeper.drop(claim.id)
        return executed
