"""One worker: `poll()` runs every stage once, in a fixed order, each bounded and wrapped in its
own try/except; `run()` is `while running: poll(); sleep`, woken early by NOTIFY. One job at a
time, awaited inline, its lease kept by the keeper (keeper.py) whatever the handler does. Opens
its connections itself, after any fork."""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
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
from ..errors import Aborted, ConfigError, LeaseLost, Partial, ResultError, Retry, is_transient
from . import lease, registry
from .backoff import retry_delay
from .context import Context, describe_error
from .deadman import Deadman
from .keeper import Held, Keeper
from .lease import Claim

if TYPE_CHECKING:
    from ..app import App
    from ..stages import Stage

Conn = psycopg.Connection[Any]
Handler = Callable[[Context, Any], Any]


class _NotWritten:
    """An outcome write that never landed (a database error); falsy."""

    def __bool__(self) -> bool:
        return False


NOT_WRITTEN: Any = _NotWritten()
# Sent by the keeper's thread to the main thread to interrupt a handler whose run must stop.
INTERRUPT_SIGNAL = signal.SIGUSR2


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
        deadman: bool = False,
        keeper_thread: bool = True,
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
        # The lease keeper renews and watches every claimed run on its own thread and connection.
        # The dead man's switch (deadman=True: the supervisor's children and the CLI's worker,
        # never a worker inside someone else's process, e.g. a test) kills the process before a
        # lease it can no longer confirm expires.
        self.keeper = Keeper(
            self.config,
            name=self.id,
            stop_at=lambda: self._stop_at,
            interrupt=self._interrupt,
            on_tick=self._keeper_tick,
        )
        self._want_deadman = deadman
        self._keeper_thread = keeper_thread
        self._main_ident: int | None = None
        self._old_interrupt_handler: Any = None
        self._durations: dict[int, float] = {}  # deferred successes: run id -> seconds it took

    # -- connections ------------------------------------------------------------------------

    def open(self) -> Worker:
        """Open the reserved control connection, check the schema, then open the pool
        (pool_size - 1 connections): a bad or missing database fails on the first connection,
        in one line, instead of in the pool's retries."""
        conn = self.control_conn()
        db.check_schema(conn)
        if self._pool is None:
            self._pool = db.make_pool(
                self.config.dsn, self.config.pool_size - 1, f"leasework:{self.id}"
            )
        if self._want_deadman and self.keeper.deadman is None:
            self.keeper.deadman = Deadman()
        self._install_interrupt()
        self.heartbeat(force=True)
        if self._keeper_thread:
            self.keeper.start()
        return self

    def _install_interrupt(self) -> None:
        """The keeper interrupts a handler by sending INTERRUPT_SIGNAL to the main thread, where
        Python runs signal handlers; a worker built on another thread is never interrupted (its
        handlers see the abort at their next ctx.check())."""
        if (
            self._main_ident is not None
            or threading.current_thread() is not threading.main_thread()
        ):
            return
        self._old_interrupt_handler = signal.signal(INTERRUPT_SIGNAL, self._on_interrupt)
        self._main_ident = threading.get_ident()

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        ctx = self.current
        if ctx is not None:
            ctx.interrupt()

    def _interrupt(self) -> None:
        """From the keeper's thread: have the main thread raise Aborted in the handler."""
        ident = self._main_ident
        if ident is not None and threading.get_ident() != ident:
            with suppress(ProcessLookupError, OSError):
                signal.pthread_kill(ident, INTERRUPT_SIGNAL)

    def interrupt_now(self) -> None:
        """In the main thread (a signal handler): raise Aborted into the running handler now."""
        ctx = self.current
        if ctx is not None:
            ctx.interrupt()

    def _keeper_tick(self, keeper: Keeper) -> None:
        self.heartbeat()
        if self.on_beat is not None:
            self.on_beat(self, self.current)

    def heartbeat(self, force: bool = False, now: float | None = None) -> None:
        """Upsert this worker's row every heartbeat_interval (standalone workers only)."""
        if not self.register:
            return
        now = time.monotonic() if now is None else now
        last = self._last_heartbeat
        if not force and last is not None and now - last < self.config.heartbeat_interval:
            return
        self._last_heartbeat = now
        current = self.current
        run_id = current.claim.id if current is not None else None
        host, pid = socket.gethostname(), os.getpid()
        try:
            # On the keeper's connection: it beats from the keeper's thread while a handler runs.
            self.keeper.run(lambda c: registry.upsert_worker(c, self.id, host, pid, run_id))
        except (psycopg.Error, db.DatabaseUnavailable, ConfigError) as exc:
            log.event("heartbeat_failed", level=30, error=log.first_line(exc))

    def close(self) -> None:
        if self.register and self._last_heartbeat is not None:
            with suppress(psycopg.Error, db.DatabaseUnavailable, ConfigError):
                self.keeper.run(lambda c: registry.stop_worker(c, self.id))
        self.keeper.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self.drop_control_conn()
        if self._main_ident is not None and threading.get_ident() == self._main_ident:
            signal.signal(INTERRUPT_SIGNAL, self._old_interrupt_handler or signal.SIG_DFL)
            self._main_ident = None

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
        with self.pool().connection() as conn:
            yield conn

    def pool(self) -> ConnectionPool[Any]:
        """The pool of connections for handlers and stages (opened on first use)."""
        if self._pool is None:
            self.open()
        assert self._pool is not None
        return self._pool

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
            log.event("listen_failed", level=30, error=log.first_line(exc))
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
            log.event("listen_failed", level=30, error=log.first_line(exc))
            self.drop_control_conn()
            time.sleep(min(seconds, 1.0))

    def stop(self, graceful: bool = True, now: float | None = None) -> None:
        """Stop claiming. Graceful: the current job gets `graceful_timeout` to finish, then its
        signal trips with `shutdown` and the run is released. Not graceful: trip it now."""
        now = time.monotonic() if now is None else now
        self.running = False
        deadline = now + (self.config.graceful_timeout if graceful else 0.0)
        self._stop_at = deadline if self._stop_at is None else min(self._stop_at, deadline)
        current = self.current
        if current is not None and not graceful:
            current.signal.trip("shutdown")
        self.keeper.wake()

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
        stored as jsonb fails the run like a handler error.

        The keeper looks after the lease from here to the outcome: renewal, cancel, timeout and
        shutdown reach the handler whether or not it calls ctx.check()."""
        held = self.keeper.get(claim.id) or self.keeper.hold(claim, sent=claim.sent)
        if held.signal.reason == "lost":
            # The claim's answer came after its lease could have run out (Keeper.hold): another
            # worker may hold the run now. Never start it.
            self.keeper.drop(claim.id)
            log.event("claim_not_started", level=30, run_id=claim.id, owner=str(claim.owner))
            return None
        self.keeper.begin(held)
        ctx = Context(claim, self, held)
        self.current = ctx
        log.event(
            "run_claimed", run_id=claim.id, kind=claim.kind, attempt=claim.attempts, worker=self.id
        )
        try:
            self.beat(ctx)  # the supervisor knows the run before its handler starts
            try:
                try:
                    ctx.interruptible = True
                    value = handler(ctx, claim.payload)
                finally:
                    ctx.interruptible = False
                    # The outcome is written next; the keeper must not take it for a lost lease.
                    self.keeper.drop(claim.id)
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
                if partial.retryable and not claim.last_attempt:
                    return self._retry(
                        ctx, None, f"Partial: {partial}", "partial", result=partial.result
                    )
                # Not retryable, or no attempt left to retry with: sealed as partial, its result
                # kept (a partial result is never thrown away as a failure).
                kept, why = self._storable(claim, partial.result), str(partial)
                return self._seal(
                    ctx,
                    "partial",
                    lambda c: lease.finish(c, claim, "partial", result=kept, error=why),
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
                self._durations[claim.id] = time.monotonic() - ctx.started
                return "succeeded"
            return self._seal(
                ctx, "succeeded", lambda c: lease.finish(c, claim, "succeeded", result=encoded)
            )
        finally:
            self.current = None
            self.keeper.drop(claim.id)
            self.jobs_done += 1

    def execute_batch(self, claims: Sequence[Claim], handler: Handler) -> int:
        """Run a batch claimed in one statement (a kind with batch=N): one run at a time, inline,
        each under its own lease, context and fence exactly as `execute`; failures, retries,
        cancels and lost leases are written at once, successes together at the end.

        The keeper holds every lease of the batch from the claim on (runs not started yet are
        renewed with the running one). A run found no longer ours before it starts is skipped,
        one cancelled meanwhile ends `cancelled` unstarted. Runs not started when the worker
        stops are released (the attempt not charged). Returns how many runs were taken in hand."""
        done: list[tuple[Claim, Any]] = []
        executed = 0
        renew_every = self.config.renew_every
        for claim in claims:
            self.keeper.hold(claim, sent=claim.sent)
        written_at = time.monotonic()
        try:
            for i, claim in enumerate(claims):
                if self.stopping:
                    break
                executed = i + 1
                now = time.monotonic()
                if (
                    done
                    and now - written_at >= renew_every * claim.lease_seconds / self.config.lease
                ):
                    # Successes are not held by the keeper: write them before their leases age.
                    self.finish_successes(done)
                    done.clear()
                    written_at = now
                self.keeper.tend(now)  # what is due (renewals, control) before the next start
                held = self.keeper.get(claim.id)
                if held is not None and held.signal.tripped:
                    self._unstarted(held)
                    continue
                self.execute(claim, handler, defer=done)
        finally:
            self.finish_successes(done)
            for claim in claims[executed:]:
                with suppress(psycopg.Error):
                    lease.release(self.control_conn(), claim, "batch stopped before this run")
                self.keeper.drop(claim.id)
        return executed

    def _unstarted(self, held: Held) -> None:
        """A batch run whose signal tripped before it started: lost (skip it) or cancelled."""
        claim = held.claim
        self.keeper.drop(claim.id)
        if held.signal.reason == "lost":
            log.event(
                "lease_lost",
                run_id=claim.id,
                owner=str(claim.owner),
                action="batch run not started",
            )
        elif held.signal.reason == "cancelled":
            self._write(
                claim, "cancelled", lambda c: lease.finish(c, claim, "cancelled", error="cancelled")
            )
            log.event("run_cancelled", run_id=claim.id, kind=claim.kind, attempt=claim.attempts)

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
                        error=log.first_line(exc),
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
        ok = self._write(
            claim, "succeeded", lambda c: lease.finish(c, claim, "succeeded", result=result)
        )
        if ok is NOT_WRITTEN:
            self._durations.pop(claim.id, None)
            return None
        self._log_sealed(claim, ok)
        return "succeeded" if ok else None

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

    def _log_sealed(self, claim: Claim, sealed: bool) -> None:
        """A deferred success written (or matching nothing: the lease was lost meanwhile)."""
        duration = self._durations.pop(claim.id, None)
        if sealed:
            log.event(
                "run_succeeded",
                run_id=claim.id,
                kind=claim.kind,
                attempt=claim.attempts,
                duration=None if duration is None else round(duration, 3),
            )
        else:
            log.event(
                "lease_lost",
                run_id=claim.id,
                owner=str(claim.owner),
                action="succeeded matched nothing",
            )

    # -- outcomes -----------------------------------------------------------------------------

    def _seal(self, ctx: Context, status: str, write: Callable[[Conn], bool]) -> str | None:
        """A terminal outcome written at once, logged with the attempt's duration."""
        claim = ctx.claim
        ok = self._write(claim, status, write)
        if not ok:
            if ok is not NOT_WRITTEN:
                self._log_lost(claim, f"{status} matched nothing")
            return None
        duration = round(time.monotonic() - ctx.started, 3)
        log.event(
            "run_" + status,
            run_id=claim.id,
            kind=claim.kind,
            attempt=claim.attempts,
            duration=duration,
        )
        return status

    def _retry(
        self, ctx: Context, after: float | None, error: str, outcome: str, result: Any = None
    ) -> str | None:
        """Requeue in place after the backoff (or `after`). The database decides what that
        means: queued again, or `failed` (no attempt left), or `cancelled` (cancel requested
        meanwhile); the log says what it returned."""
        cfg = self.config
        claim = ctx.claim
        delay = retry_delay(claim.attempts, after, cfg.backoff, cfg.backoff_jitter, self.rand)
        kept = self._storable(claim, result)
        done = self._write(
            claim,
            "requeued",
            lambda c: lease.requeue_due(
                c, claim, delay=delay, error=error, outcome=outcome, result=kept
            ),
        )
        if not done:
            if done is not NOT_WRITTEN:
                self._log_lost(claim, "requeue matched nothing")
            return None
        status: str = done[0]
        due = done[1]
        first = error.splitlines()[0] if error else None
        fields: dict[str, Any] = {"run_id": claim.id, "kind": claim.kind, "attempt": claim.attempts}
        if status == "queued":
            log.event(
                "run_retry",
                level=30,
                error=first,
                outcome=outcome,
                due_at=due.isoformat(),
                **fields,
            )
        elif status == "failed":
            log.event(
                "run_failed",
                level=40,
                error=first,
                outcome=outcome,
                attempts=claim.attempts,
                **fields,
            )
        else:
            log.event("run_" + status, **fields)
        return status

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
            self._log_lost(claim, "stopped, wrote nothing")
            return None
        if reason == "cancelled":
            kept = self._storable(claim, ctx.result)
            return self._seal(
                ctx,
                "cancelled",
                lambda c: lease.finish(c, claim, "cancelled", result=kept, error="cancelled"),
            )
        if reason == "timeout":
            return self._retry(
                ctx,
                None,
                f"timeout after {claim.timeout_seconds:g} s",
                "timeout",
                result=ctx.result,
            )
        status = self._write(
            claim, "released", lambda c: lease.release(c, claim, reason or "shutdown")
        )
        if not status:
            if status is not NOT_WRITTEN:
                self._log_lost(claim, "released matched nothing")
            return None
        log.event(
            "run_released" if status == "queued" else "run_" + status,
            run_id=claim.id,
            kind=claim.kind,
            attempt=claim.attempts,
            reason=reason or "shutdown",
        )
        return status if isinstance(status, str) else None

    def _log_lost(self, claim: Claim, action: str) -> None:
        log.event("lease_lost", run_id=claim.id, owner=str(claim.owner), action=action)

    def _write(self, claim: Claim, what: str, write: Callable[[Conn], Any]) -> Any:
        """Write an outcome on the control connection, retrying transient errors a few times, and
        return what `write` returned (None or False: the run was no longer ours), or NOT_WRITTEN
        (falsy, logged) when it never landed: the lease then lapses and another worker redoes the
        run (at least once)."""
        for attempt in range(3):
            try:
                result = write(self.control_conn())
            except psycopg.Error as exc:
                if not is_transient(exc) or attempt == 2:
                    log.event(
                        "outcome_not_recorded",
                        level=40,
                        run_id=claim.id,
                        outcome=what,
                        error=log.first_line(exc),
                    )
                    return NOT_WRITTEN
                self.drop_control_conn()
                time.sleep(0.2 * (attempt + 1))
                continue
            return result
        return NOT_WRITTEN
