"""One worker: `poll()` runs every stage once, in a fixed order, each bounded and wrapped in its
own try/except; `run()` is `while running: poll(); sleep`, woken early by NOTIFY. One job at a
time, awaited inline. Opens its connections itself, after any fork."""

from __future__ import annotations

import os
import random
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any

import orjson
import psycopg
from psycopg.types.json import set_json_loads
from psycopg_pool import ConnectionPool

from .. import db, log
from ..config import Config
from ..errors import Aborted, LeaseLost, Partial, ResultError, Retry, is_transient
from . import lease, registry
from .backoff import retry_delay
from .context import Context, describe_error
from .lease import Claim

if TYPE_CHECKING:
    from ..app import App
    from ..stages import Stage

Conn = psycopg.Connection[Any]
Handler = Callable[[Context, Any], Any]


def new_worker_id() -> str:
    """Unique per process start, never reused: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Worker:
    def __init__(
        self,
        app: App,
        config: Config | None = None,
        *,
        worker_id: str | None = None,
        stages: Sequence[Stage] | None = None,
        on_beat: Callable[[Worker, Context | None], None] | None = None,
        rand: random.Random | None = None,
        register: bool = True,
    ) -> None:
        from ..stages import default_stages

        self.app = app
        self.config = config or app.config
        self.id = worker_id or new_worker_id()
        self.stages: list[Stage] = (
            list(stages) if stages is not None else default_stages(app, self.config)
        )
        self.on_beat = on_beat
        self.rand = rand or random.Random()
        self.running = False
        self.jobs_done = 0
        self.current: Context | None = None
        self._pool: ConnectionPool[Any] | None = None
        self._control: Conn | None = None
        self._stop_at: float | None = None  # monotonic time the current job must be aborted by
        self._draining = False  # stop claiming, but let the job in hand finish with no deadline
        self._listening = False
        # Payloads of the NOTIFYs received since the run loop last looked (a task kind, or
        # `upload`): at most one entry per kind, however many enqueues sent them.
        self._woken: set[str] = set()
        self._idle_until: dict[str, float] = {}  # stage name -> monotonic time to ask it again
        # A standalone worker keeps its own row in the workers table; under the supervisor the
        # parent writes the rows instead (register=False).
        self.register = register
        self._last_heartbeat: float | None = None

    # -- connections ------------------------------------------------------------------------

    def open(self) -> Worker:
        """Open the pool (pool_size - 1 connections) and the reserved control connection."""
        if self._pool is None:
            self._pool = db.make_pool(
                self.config.dsn, self.config.pool_size - 1, f"leasework:{self.id}"
            )
        conn = self.control_conn()
        db.check_schema(conn)
        self.heartbeat(force=True)
        return self

    def heartbeat(self, force: bool = False, now: float | None = None) -> None:
        """Upsert this worker's row every heartbeat_interval (standalone workers only)."""
        if not self.register:
            return
        now = time.monotonic() if now is None else now
        last = self._last_heartbeat
        if not force and last is not None and now - last < self.config.heartbeat_interval:
            return
        run_id = self.current.claim.id if self.current is not None else None
        try:
            registry.upsert_worker(
                self.control_conn(), self.id, socket.gethostname(), os.getpid(), run_id
            )
            self._last_heartbeat = now
        except psycopg.Error as exc:
            log.event(
                "heartbeat_failed",
                level=30,
                error=log.first_line(exc),
            )
            self.drop_control_conn()

    def close(self) -> None:
        if self.register and self._control is not None and not self._control.closed:
            with suppress(psycopg.Error):
                registry.stop_worker(self._control, self.id)
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self.drop_control_conn()

    def __enter__(self) -> Worker:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def control_conn(self) -> Conn:
        """The connection reserved for renewal, control and LISTEN; reopened if it broke."""
        if self._control is None or self._control.closed or self._control.broken:
            self.drop_control_conn()
            self._control = db.connect(
                self.config.dsn, application_name=f"leasework:{self.id}:control"
            )
            # Only leasework's own statements run here (claim, settle, renew, control, outcomes),
            # each a prepared statement whose generic plan is as good as a custom one: planning
            # the claim afresh on every call cost more than executing it (bench/README.md).
            self._control.execute("SET plan_cache_mode = force_generic_plan")
            # Payloads and results decode with orjson, as they were encoded (app.encode_payload).
            set_json_loads(orjson.loads, self._control)
            self._listening = False
        return self._control

    def drop_control_conn(self) -> None:
        if self._control is not None:
            with suppress(Exception):
                self._control.close()
        self._control = None
        self._listening = False

    @contextmanager
    def pool_connection(self) -> Iterator[Conn]:
        if self._pool is None:
            self.open()
        assert self._pool is not None
        with self._pool.connection() as conn:
            yield conn

    # -- the loop ---------------------------------------------------------------------------

    def poll(self, *, skip_idle: bool = False) -> int:
        """Run every stage once, in order. Returns how many items the stages handled.

        skip_idle (used by `run()` between back-to-back polls while work keeps coming): a stage
        that found nothing is not asked again until poll_interval has passed, the seed's own poll
        period, so a busy queue of short runs does not pay every idle stage's queries per batch.
        """
        done = 0
        now = time.monotonic()
        for stage in self.stages:
            if self.stopping:
                break
            if skip_idle and now < self._idle_until.get(stage.name, 0.0):
                continue
            handled = 0
            try:
                handled = stage.step(self)
            except Exception as exc:  # one failing stage never skips the ones after it
                level = 30 if is_transient(exc) else 40
                log.event(
                    "stage_failed", level=level, stage=stage.name, error=describe_error(exc, 3)
                )
            done += handled
            if handled:
                self._idle_until.pop(stage.name, None)
            else:
                self._idle_until[stage.name] = now + self.config.poll_interval
        self.drain_notifies()
        self.beat(None)
        return done

    def run(self, *, once: bool = False) -> None:
        """Poll until stopped. Does not sleep after a poll that found work; an idle sleep wakes
        at once on a NOTIFY from enqueue (polling stays the fallback)."""
        self.open()
        self.running = True
        log.event(
            "worker_started", worker=self.id, pid=os.getpid(), stages=[s.name for s in self.stages]
        )
        skip_idle = False
        try:
            while self.running:
                try:
                    found = self.poll(skip_idle=skip_idle)
                except Exception as exc:  # poll() already isolates stages; this is belt and braces
                    log.event("poll_failed", level=40, error=describe_error(exc, 3))
                    found = 0
                if once:
                    break
                skip_idle = found > 0
                if found == 0 and self.running:
                    woken = self.idle_wait(self.config.poll_interval)
                else:
                    woken, self._woken = self._woken, set()
                # Woken by a NOTIFY naming a kind: ask its stage at once and leave the stages
                # polled a moment ago for their next turn (pickup latency, bench/README.md).
                for stage in {self.stage_for(p) for p in woken}:
                    if stage is not None:
                        self._idle_until.pop(stage, None)
                        skip_idle = True
        finally:
            self.running = False
            log.event("worker_stopped", worker=self.id, jobs=self.jobs_done)
            self.close()

    def stage_for(self, payload: str | None) -> str | None:
        """The stage that serves a NOTIFY's payload (a task kind, or `upload`); None if unknown."""
        if payload is None:
            return None
        if payload == "upload":
            return "expand"
        task = self.app.tasks.get(payload)
        return task.stage if task is not None else None

    def _note(self, payload: str) -> None:
        """Remember a NOTIFY's payload if it names something this worker serves, so `_woken`
        holds at most one entry per kind whatever is sent on the channel. Any NOTIFY still ends
        an idle wait (the supervisor's fast release sends one without a kind)."""
        if self.stage_for(payload) is not None:
            self._woken.add(payload)

    def drain_notifies(self) -> None:
        """Move the NOTIFYs psycopg kept while the control connection was busy (it holds every
        one it reads during a claim, a renewal or a control query) into `_woken`, one entry per
        kind. Called after each poll and each renewal or control query: a busy worker under a
        steady stream of enqueues would otherwise hold one object per enqueue until it next
        slept, and then wake once for each."""
        conn = self._control
        if conn is None or not self._listening or conn.closed or conn.broken:
            return
        try:
            for note in conn.notifies(timeout=0):
                self._note(note.payload)
        except psycopg.Error as exc:
            log.event(
                "listen_failed", level=30, error=log.first_line(exc)
            )
            self.drop_control_conn()

    def idle_wait(self, seconds: float) -> set[str]:
        """The payloads of the NOTIFYs received since the last call (a task kind, or `upload`),
        waiting up to `seconds` for one when there are none yet; empty on a timeout.
        Re-LISTENs after a reconnect."""
        if not self._woken:
            self._wait_for_notify(seconds)
        woken, self._woken = self._woken, set()
        return woken

    def _wait_for_notify(self, seconds: float) -> None:
        try:
            conn = self.control_conn()
            if not self._listening:
                conn.execute(f"LISTEN {db.NOTIFY_CHANNEL}")
                self._listening = True
            # Consumed to the end: with stop_after=1 psycopg still yields the rest of the packet
            # that brought the first one, which would otherwise be lost.
            for note in conn.notifies(timeout=seconds, stop_after=1):
                self._note(note.payload)
        except psycopg.Error as exc:
            log.event(
                "listen_failed", level=30, error=log.first_line(exc)
            )
            self.drop_control_conn()
            time.sleep(min(seconds, 1.0))

    def stop(self, graceful: bool = True, now: float | None = None) -> None:
        """Stop claiming. Graceful: the current job gets `graceful_timeout` to finish, then its
        signal trips with `shutdown` and the run is released. Not graceful: trip it now."""
        now = time.monotonic() if now is None else now
        self.running = False
        deadline = now + (self.config.graceful_timeout if graceful else 0.0)
        self._stop_at = deadline if self._stop_at is None else min(self._stop_at, deadline)
        if self.current is not None and not graceful:
            self.current.signal.trip("shutdown")

    def drain(self) -> None:
        """Stop claiming after the job in hand, which finishes with no deadline (recycling a
        child after max_jobs_per_child). Every stage checks `stopping` before it claims."""
        self.running = False
        self._draining = True

    @property
    def stopping(self) -> bool:
        return self._draining or self._stop_at is not None

    def shutdown_reason(self, now: float) -> str | None:
        if self._stop_at is not None and now >= self._stop_at:
            return "shutdown"
        return None

    def beat(self, ctx: Context | None) -> None:
        """Liveness: called after each poll and each ctx.check(); the supervisor listens."""
        self.heartbeat()
        if self.on_beat is not None:
            self.on_beat(self, ctx)

    # -- executing one claimed run ------------------------------------------------------------

    def execute(
        self, claim: Claim, handler: Handler, *, defer: list[tuple[Claim, Any]] | None = None
    ) -> str | None:
        """Run the handler inline under the claim's lease and record the outcome (owner-scoped).
        Returns the run's new status, or None when the lease was lost and nothing was written.
        With `defer`, a success is appended there (its result encoded) for the caller to seal:
        with the batch's others (`finish_successes`) or with the next claim
        (`finish_and_claim`); every other outcome is written at once. A result that cannot be
        stored as jsonb fails the run like a handler error."""
        cfg = self.config
        ratio = claim.lease_seconds / cfg.lease
        ctx = Context(
            claim,
            self,
            renew_every=cfg.renew_interval * ratio,
            control_every=min(cfg.control_interval, cfg.renew_interval * ratio / 2),
        )
        self.current = ctx
        log.event(
            "run_claimed", run_id=claim.id, kind=claim.kind, attempt=claim.attempts, worker=self.id
        )
        try:
            try:
                value = handler(ctx, claim.payload)
            except LeaseLost:
                ctx.signal.trip("lost")
                return self._settle_aborted(ctx)
            except Aborted:
                return self._settle_aborted(ctx)
            except Retry as exc:
                if ctx.signal.tripped:
                    return self._settle_aborted(ctx)
                # ctx.result (what the handler gathered so far) is kept across the retry, as on
                # cancel: a sync's per-table results accumulate on the one run.
                return self._retry(ctx, exc.after, f"Retry: {exc}", "retry", result=ctx.result)
            except Partial as partial:
                ctx.result = partial.result
                if ctx.signal.tripped:
                    return self._settle_aborted(ctx)
                if partial.retryable:
                    return self._retry(
                        ctx, None, f"Partial: {partial}", "partial", result=partial.result
                    )
                sealed, why = self._storable(claim, partial.result), str(partial)
                return self._record(
                    lambda c: lease.finish(c, claim, "partial", result=sealed, error=why),
                    claim,
                    "partial",
                )
            except Exception as exc:
                if ctx.signal.tripped:
                    return self._settle_aborted(ctx)
                return self._retry(ctx, None, describe_error(exc), "failed", result=ctx.result)
            except BaseException:
                # KeyboardInterrupt, SystemExit: give the run back before leaving.
                ctx.signal.trip("shutdown")
                self._settle_aborted(ctx)
                raise
            # A handler that swallowed Aborted still ends by the signal's reason; one that simply
            # finished is recorded as succeeded (finish is owner-scoped, so a lost lease writes
            # nothing).
            if ctx.signal.tripped:
                ctx.result = value if value is not None else ctx.result
                return self._settle_aborted(ctx)
            try:
                encoded = lease.encode_result(value)
            except ResultError as exc:
                return self._retry(ctx, None, str(exc), "failed", result=ctx.result)
            if defer is not None:
                defer.append((claim, encoded))
                return "succeeded"
            return self._record(
                lambda c: lease.finish(c, claim, "succeeded", result=encoded), claim, "succeeded"
            )
        finally:
            self.current = None
            self.jobs_done += 1

    def execute_batch(self, claims: Sequence[Claim], handler: Handler) -> int:
        """Run a batch claimed in one statement (a kind with batch=N): one run at a time, inline,
        each under its own lease, context and fence exactly as `execute`; failures, retries,
        cancels and lost leases are written at once, successes together at the end.

        The batch's leases were all taken at claim time. Each time a third of the lease has
        passed, the successes so far are written and every run not yet started is renewed (one
        that is no longer ours is skipped, never started). Runs not started when the worker
        stops are released (the attempt not charged). Returns how many runs were taken in hand."""
        done: list[tuple[Claim, Any]] = []
        lost: set[int] = set()
        executed = 0
        renewed_at = time.monotonic()
        try:
            for i, claim in enumerate(claims):
                if self.stopping:
                    break
                executed = i + 1
                now = time.monotonic()
                if (
                    now - renewed_at
                    >= self.config.renew_interval * claim.lease_seconds / self.config.lease
                ):
                    self.finish_successes(done)
                    done.clear()
                    for waiting in claims[i:]:
                        if (
                            waiting.id not in lost
                            and lease.renew(self.control_conn(), waiting) is None
                        ):
                            lost.add(waiting.id)
                            log.event(
                                "lease_lost",
                                run_id=waiting.id,
                                owner=str(waiting.owner),
                                action="batch run not started",
                            )
                    renewed_at = now
                if claim.id not in lost:
                    self.execute(claim, handler, defer=done)
        finally:
            self.finish_successes(done)
            for claim in claims[executed:]:
                with suppress(psycopg.Error):
                    lease.release(self.control_conn(), claim, "batch stopped before this run")
        return executed

    def finish_successes(self, done: Sequence[tuple[Claim, Any]]) -> set[int]:
        """Write a batch's successes in one owner-scoped statement, retrying transient errors a
        few times; a run whose lease was lost meanwhile is logged and nothing is written for it.
        If the write never lands, the leases lapse and the runs are redone (at least once)."""
        if not done:
            return set()
        for attempt in range(3):
            try:
                ok = lease.finish_many(self.control_conn(), done)
            except psycopg.Error as exc:
                if not is_transient(exc) or attempt == 2:
                    log.event(
                        "outcome_not_recorded",
                        level=40,
                        run_ids=[c.id for c, _ in done],
                        outcome="succeeded",
                        error=str(exc),
                    )
                    return set()
                self.drop_control_conn()
                time.sleep(0.2 * (attempt + 1))
                continue
            for claim, _ in done:
                self._log_sealed(claim, claim.id in ok)
            return ok
        return set()

    def finish_success(self, claim: Claim, result: Any) -> str | None:
        """Seal one deferred success on its own (owner-scoped, transient errors retried)."""
        return self._record(
            lambda c: lease.finish(c, claim, "succeeded", result=result), claim, "succeeded"
        )

    def finish_and_claim(self, done: tuple[Claim, Any], kinds: Sequence[str]) -> list[Claim] | None:
        """Seal a deferred success and claim the next run in one statement (one round trip, one
        synchronous commit): one-at-a-time mode's steady state. Returns the claimed run (or an
        empty list); None after a database error, when the success has been sealed on its own
        instead (with `finish_success`'s retries) and the caller claims on its own. Only for a
        run without a tenant (lease.finish_and_claim)."""
        claim, result = done
        try:
            sealed, nxt = lease.finish_and_claim(
                self.control_conn(),
                claim,
                kinds,
                worker=self.id,
                lease=self.config.lease,
                result=result,
            )
        except psycopg.Error as exc:
            log.event(
                "finish_and_claim_failed",
                level=30,
                run_id=claim.id,
                error=log.first_line(exc),
            )
            if self._control is not None and self._control.broken:
                self.drop_control_conn()
            self.finish_success(claim, result)
            return None
        self._log_sealed(claim, sealed)
        return [] if nxt is None else [nxt]

    @staticmethod
    def _log_sealed(claim: Claim, sealed: bool) -> None:
        """A deferred success written (or matching nothing: the lease was lost meanwhile)."""
        if sealed:
            log.event("run_succeeded", run_id=claim.id, kind=claim.kind, attempt=claim.attempts)
        else:
            log.event(
                "lease_lost",
                run_id=claim.id,
                owner=str(claim.owner),
                action="succeeded matched nothing",
            )

    def _retry(
        self, ctx: Context, after: float | None, error: str, outcome: str, result: Any = None
    ) -> str | None:
        cfg = self.config
        delay = retry_delay(ctx.claim.attempts, after, cfg.backoff, cfg.backoff_jitter, self.rand)
        status: list[str | None] = [None]
        kept = self._storable(ctx.claim, result)

        def write(c: Conn) -> bool:
            status[0] = lease.requeue(
                c, ctx.claim, delay=delay, error=error, outcome=outcome, result=kept
            )
            return status[0] is not None

        self._record(write, ctx.claim, "requeued")
        return status[0]

    def _storable(self, claim: Claim, result: Any) -> Any:
        """`result` encoded for jsonb, or None (keep what the run has) if it cannot be stored,
        which is logged: an outcome is never lost to an unstorable result."""
        try:
            return lease.encode_result(result)
        except ResultError as exc:
            log.event("result_not_stored", level=30, run_id=claim.id, error=str(exc))
            return None

    def _settle_aborted(self, ctx: Context) -> str | None:
        claim = ctx.claim
        reason = ctx.signal.reason
        if reason == "lost":
            log.event(
                "lease_lost",
                run_id=claim.id,
                owner=str(claim.owner),
                action="stopped, wrote nothing",
            )
            return None
        if reason == "cancelled":
            kept = self._storable(claim, ctx.result)
            return self._record(
                lambda c: lease.finish(c, claim, "cancelled", result=kept, error="cancelled"),
                claim,
                "cancelled",
            )
        if reason == "timeout":
            return self._retry(
                ctx,
                None,
                f"timeout after {claim.timeout_seconds:g} s",
                "timeout",
                result=ctx.result,
            )
        status: list[str | None] = [None]

        def write(c: Conn) -> bool:
            status[0] = lease.release(c, claim, reason or "shutdown")
            return status[0] is not None

        self._record(write, claim, "released")
        return status[0]

    def _record(self, write: Callable[[Conn], bool], claim: Claim, what: str) -> str | None:
        """Write an outcome on the control connection, retrying transient errors a few times.
        If it never lands, the lease lapses and another worker redoes the run (at least once)."""
        for attempt in range(3):
            try:
                ok = write(self.control_conn())
            except psycopg.Error as exc:
                if not is_transient(exc) or attempt == 2:
                    log.event(
                        "outcome_not_recorded",
                        level=40,
                        run_id=claim.id,
                        outcome=what,
                        error=str(exc),
                    )
                    return None
                self.drop_control_conn()
                time.sleep(0.2 * (attempt + 1))
                continue
            if not ok:
                log.event(
                    "lease_lost",
                    run_id=claim.id,
                    owner=str(claim.owner),
                    action=f"{what} matched nothing",
                )
                return None
            log.event("run_" + what, run_id=claim.id, kind=claim.kind, attempt=claim.attempts)
            return what
        return None
