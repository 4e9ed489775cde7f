"""The end of every attempt, in one place: what it means (outcome.decide, pure) and its write,
owner-scoped, through lease.py: at once, with a batch's other successes (finish_many), or riding
on the next claim (finish_and_claim). Sync and async runs alike; never runs job code. A lost
lease writes nothing."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any, Protocol

import psycopg

from .. import log
from ..config import Config
from ..errors import LeaseLost, ResultError, gave_up_on_lock, is_transient
from ..leases import lease
from ..leases.lease import Claim
from .backoff import retry_delay
from .connections import Connections
from .context import describe_error
from .keeper import AbortSignal, Held
from .outcome import Outcome, Sealed, decide

Conn = psycopg.Connection[Any]
Done = tuple[Claim, Any]  # a success not sealed yet: its claim and its encoded result


class Attempt(Protocol):
    """What deciding and writing an attempt's end needs of its context: a sync handler's
    `Context` or an async one's `AsyncContext`."""

    claim: Claim
    signal: AbortSignal
    result: Any
    started: float


class _NotWritten:
    """An outcome write that never landed (a database error); falsy."""

    def __bool__(self) -> bool:
        return False


NOT_WRITTEN: Any = _NotWritten()


class Completer:
    def __init__(
        self,
        config: Config,
        *,
        worker_id: str,
        conns: Connections,
        rand: random.Random | None = None,
    ) -> None:
        self.config = config
        self.worker_id = worker_id
        self.conns = conns
        self.rand = rand or random.Random()
        self._durations: dict[int, float] = {}  # unsealed successes: run id -> seconds it took
        # One-at-a-time mode's chain of seal-and-claims (lease.Chain): the quick statement while
        # nothing only the whole claim takes is due, looked at again every poll_interval once
        # something was; its own prepared statement, a kept cursor.
        self._chain = lease.Chain(recheck=config.poll_interval)

    @property
    def chain(self) -> lease.Chain:
        """The chain's prepared statements, for a claim of its own (lease.claim_runs)."""
        return self._chain

    # -- an attempt's end -----------------------------------------------------------------------

    def conclude(
        self,
        attempt: Attempt,
        returned: Any,
        raised: BaseException | None,
        *,
        defer: list[Done] | None = None,
    ) -> str | None:
        """The handler returned `returned` or raised `raised`: decide what that means and write
        it. Returns the run's new status, or None when nothing was written (the lease was lost,
        or the write never landed). With `defer`, a success is appended there (its result
        encoded) for the caller to seal: with others (`seal_successes`) or with the next claim
        (`seal_and_claim`); every other outcome is written at once. A result that cannot be
        stored as jsonb fails the attempt. The keeper must no longer hold the run."""
        claim = attempt.claim
        if raised is None and attempt.signal.reason is None:
            # What decide() answers for a run that returned and need not stop (every success of
            # a batch: once per run), without the call.
            outcome = Outcome("seal", status="succeeded", result=returned)
        else:
            if isinstance(raised, LeaseLost):
                attempt.signal.trip("lost")
            outcome = decide(
                returned,
                raised,
                attempt.signal.reason,
                gathered=attempt.result,
                last_attempt=claim.last_attempt,
                timeout=claim.timeout_seconds,
                describe=describe_error,
            )
        if outcome.action == "seal" and outcome.status == "succeeded":
            try:
                encoded = lease.encode_result(outcome.result, self.config.result_max_bytes)
            except ResultError as exc:
                outcome = Outcome("requeue", label="failed", error=str(exc), result=attempt.result)
            else:
                if defer is not None:
                    defer.append((claim, encoded))
                    self._durations[claim.id] = time.monotonic() - attempt.started
                    return "succeeded"
                outcome = Outcome("seal", status="succeeded", result=encoded)
        return self.write(attempt, outcome)

    def unstarted(self, held: Held) -> None:
        """A batch run whose signal tripped before it started: lost (skip it) or cancelled."""
        claim = held.claim
        if held.signal.reason == "lost":
            self._log_lost(claim, "batch run not started")
        elif held.signal.reason == "cancelled":
            self._write(
                claim, "cancelled", lambda c: lease.finish(c, claim, "cancelled", error="cancelled")
            )
            log.event("run_cancelled", run_id=claim.id, kind=claim.kind, attempt=claim.attempts)

    def give_back(self, claims: Sequence[Claim], why: str) -> None:
        """Release runs never started (a batch's, the worker stopping): the attempt not charged.
        A failed release is left to the lease's expiry."""
        for claim in claims:
            with suppress(psycopg.Error):
                lease.release(self.conns.main(), claim, why)

    # -- sealing successes ----------------------------------------------------------------------

    def seal_successes(self, done: Sequence[Done]) -> set[int]:
        """Seal successes in one owner-scoped statement, retrying transient errors a few times;
        a run whose lease was lost meanwhile is logged and nothing is written for it. If the
        write never lands, the leases lapse and the runs are redone (at least once)."""
        if not done:
            return set()
        ok = self._write(done[0][0], "succeeded", lambda c: lease.finish_many(c, done))
        if ok is NOT_WRITTEN:
            for claim, _ in done:
                self._durations.pop(claim.id, None)
            return set()
        durations = self._durations
        quick = None if log.enabled(logging.DEBUG) else self.config.log_runs_slower_than
        for claim, _ in done:
            if quick is not None and claim.id in ok:
                # A quick success is logged at debug only (_log_sealed), which is off: the
                # check made once for the batch, not per run.
                duration = durations.get(claim.id)
                if duration is not None and duration < quick:
                    del durations[claim.id]
                    continue
            self._log_sealed(claim, claim.id in ok)
        return set(ok)

    def seal_aging(self, done: list[Done], since: float, now: float, renew: float) -> float:
        """A batch's successes wait in `done` for one seal, but the keeper no longer holds them:
        seal them before their leases age by a renewal's time (`renew`) since `since`, when they
        were last written. Returns when they were last written."""
        if not done or now - since < renew:
            return since
        self.seal_successes(done)
        done.clear()
        return now

    def seal_success(self, claim: Claim, result: Any) -> str | None:
        """Seal one success on its own (owner-scoped, transient errors retried)."""
        ok = self._write(
            claim, "succeeded", lambda c: lease.finish(c, claim, "succeeded", result=result)
        )
        if ok is NOT_WRITTEN:
            self._durations.pop(claim.id, None)
            return None
        self._log_sealed(claim, ok)
        return "succeeded" if ok else None

    def seal_and_claim(self, done: Done, kinds: Sequence[str]) -> list[Claim] | None:
        """Seal a success and claim the next run in one statement (one round trip, one
        synchronous commit): one-at-a-time mode's steady state. Returns the claimed run (or an
        empty list); None after a database error, when the success has been sealed on its own
        instead and the caller claims on its own."""
        claim, result = done
        try:
            sealed, nxt = lease.finish_and_claim(
                self.conns.main(),
                claim,
                kinds,
                worker=self.worker_id,
                lease=self.config.lease,
                result=result,
                chain=self._chain,
            )
        except psycopg.Error as exc:
            log.event(
                "finish_and_claim_failed", level=30, run_id=claim.id, error=log.first_line(exc)
            )
            if gave_up_on_lock(exc):
                # The seal met a lock held past lock_timeout (the claim skips locked rows): a
                # seal on its own would wait as long again. Given up like _write does.
                self._durations.pop(claim.id, None)
            else:
                self.seal_success(claim, result)
            return None
        self._log_sealed(claim, sealed)
        return [] if nxt is None else [nxt]

    def _log_sealed(self, claim: Claim, sealed: bool) -> None:
        duration = self._durations.pop(claim.id, None)
        if sealed:
            # At info only when it took log_runs_slower_than or longer: quick successes, a line
            # each at thousands a second, at debug (failures and retries are logged at warning
            # and above whatever they took).
            slow = duration is None or duration >= self.config.log_runs_slower_than
            level = logging.INFO if slow else logging.DEBUG
            if not log.enabled(level):
                return
            log.event(
                "run_succeeded",
                level=level,
                run_id=claim.id,
                kind=claim.kind,
                attempt=claim.attempts,
                duration=None if duration is None else round(duration, 3),
            )
        else:
            self._log_lost(claim, "succeeded matched nothing")

    # -- writing an outcome -------------------------------------------------------------------

    def write(self, attempt: Attempt, outcome: Outcome) -> str | None:
        """Write a decided outcome (a success's result encoded already). Returns the run's new
        status, or None when nothing was written."""
        claim = attempt.claim
        if outcome.action == "nothing":
            self._log_lost(claim, "stopped, wrote nothing")
            return None
        if outcome.action == "requeue":
            return self._requeue(attempt, outcome)
        if outcome.action == "snooze":
            return self._snooze(attempt, outcome)
        if outcome.action == "release":
            why = outcome.error or "shutdown"
            released = self._write(claim, "released", lambda c: lease.release(c, claim, why))
            if not released:
                if released is not NOT_WRITTEN:
                    self._log_lost(claim, "released matched nothing")
                return None
            log.event(
                "run_released" if released == "queued" else "run_" + released,
                run_id=claim.id,
                kind=claim.kind,
                attempt=claim.attempts,
                reason=why,
            )
            return released if isinstance(released, str) else None
        status: Sealed = outcome.status or "succeeded"
        if status == "failed":
            return self._fail(attempt, outcome)
        kept = outcome.result if status == "succeeded" else self._storable(claim, outcome.result)
        ok = self._write(
            claim,
            status,
            lambda c: lease.finish(c, claim, status, result=kept, error=outcome.error),
        )
        if not ok:
            if ok is not NOT_WRITTEN:
                self._log_lost(claim, f"{status} matched nothing")
            return None
        log.event(
            "run_" + status,
            run_id=claim.id,
            kind=claim.kind,
            attempt=claim.attempts,
            duration=round(time.monotonic() - attempt.started, 3),
        )
        return status

    def _requeue(self, attempt: Attempt, outcome: Outcome) -> str | None:
        """Requeue in place after the backoff (or `after`). The database decides what that
        means: queued again, or `failed` (no attempt left), or `cancelled` (cancel requested
        meanwhile); the log says what it returned."""
        cfg = self.config
        claim = attempt.claim
        delay = retry_delay(
            claim.attempts, outcome.after, cfg.backoff, cfg.backoff_jitter, self.rand
        )
        kept = self._storable(claim, outcome.result)
        error, label = outcome.error or "", outcome.label or "failed"
        done = self._write(
            claim,
            "requeued",
            lambda c: lease.requeue_due(
                c, claim, delay=delay, error=error, outcome=label, result=kept
            ),
        )
        if not done:
            if done is not NOT_WRITTEN:
                self._log_lost(claim, "requeue matched nothing")
            return None
        status: str = done[0]
        fields: dict[str, Any] = {"run_id": claim.id, "kind": claim.kind, "attempt": claim.attempts}
        first = error.splitlines()[0] if error else None
        if status == "queued":
            log.event(
                "run_retry",
                level=30,
                error=first,
                outcome=label,
                due_at=done[1].isoformat(),
                **fields,
            )
        elif status == "failed":
            log.event(
                "run_failed",
                level=40,
                error=first,
                outcome=label,
                attempts=claim.attempts,
                **fields,
            )
        else:
            log.event("run_" + status, **fields)
        return status

    def _snooze(self, attempt: Attempt, outcome: Outcome) -> str | None:
        """Requeue after `after` seconds without charging the attempt (a handler's Snooze). The
        database decides what that means: queued again, or `failed` (the run's snoozes used up:
        max_snoozes), or `cancelled` (cancel requested meanwhile)."""
        claim = attempt.claim
        kept = self._storable(claim, outcome.result)
        cap = self.config.max_snoozes
        done = self._write(
            claim,
            "snoozed",
            lambda c: lease.snooze(
                c,
                claim,
                after=outcome.after or 0.0,
                max_snoozes=cap,
                reason=outcome.error,
                result=kept,
            ),
        )
        if not done:
            if done is not NOT_WRITTEN:
                self._log_lost(claim, "snooze matched nothing")
            return None
        status: str = done.status
        fields: dict[str, Any] = {"run_id": claim.id, "kind": claim.kind, "attempt": claim.attempts}
        if status == "queued":
            log.event(
                "run_snoozed",
                due_at=done.due_at.isoformat(),
                snoozes=done.snoozes,
                reason=outcome.error,
                **fields,
            )
        elif status == "failed":
            log.event(
                "run_failed",
                level=40,
                error=f"snoozed too often (max_snoozes = {cap})",
                outcome="snoozed",
                attempts=claim.attempts,
                **fields,
            )
        else:
            log.event("run_" + status, **fields)
        return status

    def _fail(self, attempt: Attempt, outcome: Outcome) -> str | None:
        """End the run `failed` now, no retry (a handler's Fail); `cancelled` if a cancel was
        requested meanwhile, as a retry's requeue would."""
        claim = attempt.claim
        kept = self._storable(claim, outcome.result)
        error = outcome.error or "Fail"
        status = self._write(
            claim, "failed", lambda c: lease.fail(c, claim, error=error, result=kept)
        )
        if not status:
            if status is not NOT_WRITTEN:
                self._log_lost(claim, "failed matched nothing")
            return None
        fields: dict[str, Any] = {"run_id": claim.id, "kind": claim.kind, "attempt": claim.attempts}
        if status == "failed":
            log.event(
                "run_failed",
                level=40,
                error=error.splitlines()[0] if error else None,
                outcome="fail",
                attempts=claim.attempts,
                duration=round(time.monotonic() - attempt.started, 3),
                **fields,
            )
        else:
            log.event("run_" + status, **fields)
        return str(status)

    def _storable(self, claim: Claim, result: Any) -> Any:
        """`result` encoded for jsonb, or None (keep what the run has) if it cannot be stored,
        which is logged: an outcome is never lost to an unstorable result."""
        try:
            return lease.encode_result(result, self.config.result_max_bytes)
        except ResultError as exc:
            log.event("result_not_stored", level=30, run_id=claim.id, error=str(exc))
            return None

    def _log_lost(self, claim: Claim, action: str) -> None:
        log.event("lease_lost", run_id=claim.id, owner=str(claim.owner), action=action)

    def _write(self, claim: Claim, what: str, write: Callable[[Conn], Any]) -> Any:
        """Write an outcome on the main connection, retrying transient errors a few times, and
        return what `write` returned (None or False: the run was no longer ours), or NOT_WRITTEN
        (falsy, logged) when it never landed: the lease then lapses and another worker redoes the
        run (at least once)."""
        for attempt in range(3):
            try:
                return write(self.conns.main())
            except psycopg.Error as exc:
                # Another session holding the row past lock_timeout (an operator's SELECT ...
                # FOR UPDATE): waiting longer would stall this worker on it, so the write is
                # given up (a warning) and the run redone once its lease lapses and the row is
                # free. Any other error but a transient one, or the third: an error.
                locked = gave_up_on_lock(exc)
                if locked or not is_transient(exc) or attempt == 2:
                    log.event(
                        "outcome_not_recorded",
                        level=30 if locked else 40,
                        run_id=claim.id,
                        outcome=what,
                        error=log.first_line(exc),
                    )
                    return NOT_WRITTEN
                self.conns.drop_main()
                time.sleep(0.2 * (attempt + 1))
        return NOT_WRITTEN
