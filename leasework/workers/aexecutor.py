"""Async handlers: several runs at once on one asyncio event loop in the worker's main thread, each
under its own claim, lease, owner token and abort signal. The keeper (its own thread) holds every
lease whatever the loop is doing; a run that must stop has its task cancelled (AsyncContext.deliver);
its end is decided and written by the completer (workers/completer.py), as a sync run's is.
Successes wait in `done` for the stage's next step, which seals them in one statement (finish_runs)
before it claims the free slots in one more.

The loop turns every TICK seconds; the keeper's thread notices a loop that has not turned for
LAG_WARN (a synchronous call inside an async handler: every run of the worker waits behind it)
and logs it with the run it caught running. A sync handler of the same worker runs inline on the
loop (docs/async.md, Mixing): that stall is expected, and logged at DEBUG only. The
dead man's switch and the parent's watchdog still cover such a run: its interruption cannot land
while the loop is blocked."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from contextlib import suppress
from typing import Any

from psycopg_pool import AsyncConnectionPool

from .. import db, log, tracing
from ..errors import Aborted
from ..leases.lease import Claim
from .acontext import AsyncContext
from .completer import Done
from .executor import Executor, log_claimed, traced_end
from .keeper import Held

AsyncHandler = Callable[[AsyncContext, Any], Coroutine[Any, Any, Any]]

TICK = 0.25  # seconds between the loop's turns it records
LAG_WARN = 1.0  # seconds without a turn before the keeper logs who blocks the loop


class AsyncExecutor:
    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.config = executor.config
        self.worker_id = executor.worker_id
        self.keeper = executor.keeper
        self.completer = executor.completer
        self.loop: asyncio.AbstractEventLoop | None = None
        self.running: dict[int, AsyncContext] = {}  # run id -> its context (and task)
        self.done: list[Done] = []  # successes not sealed yet: their claims and encoded results
        # Set by the stage after a claim that filled its limit: there may be more to claim.
        self.claim_more = False
        self._changed: asyncio.Event | None = None
        self._apool: AsyncConnectionPool[Any] | None = None
        self.serving = False  # the worker's loop is running (else a poll runs its runs to the end)
        self._ticker: asyncio.TimerHandle | None = None
        self._turned = time.monotonic()
        self._tick_due = float("inf")
        self._blocked: tuple[int | None, float] | None = None  # the run caught blocking, since

    # -- the loop -------------------------------------------------------------------------------

    def get_loop(self) -> asyncio.AbstractEventLoop:
        if self.loop is None or self.loop.is_closed():
            self.loop = asyncio.new_event_loop()
            self._changed = None
        return self.loop

    @property
    def changed(self) -> asyncio.Event:
        """Set when a run ends (a slot frees, a success waits for its seal)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def serve(self, main: Coroutine[Any, Any, None]) -> None:
        """Run the worker's loop (`main`) on this executor's event loop until it returns."""
        loop = self.get_loop()
        self.serving = True
        self._turned = time.monotonic()
        self._tick_due = self._turned + TICK
        self._ticker = loop.call_later(TICK, self._tick)
        try:
            loop.run_until_complete(main)
        finally:
            self.serving = False
            if self._ticker is not None:
                self._ticker.cancel()
                self._ticker = None

    def _tick(self) -> None:
        now = time.monotonic()
        late = now - self._tick_due
        if late > LAG_WARN:
            blocked = self._blocked
            run_id = None if blocked is None else blocked[0]
            # A sync handler run inline meanwhile is what a mixed worker does, not a blocking
            # call in an async handler: DEBUG, unless an async run was caught holding the loop.
            ex = self.executor
            sync = ex.current is not None or ex.sync_ended > self._turned
            log.event(
                "loop_lagged",
                level=30 if run_id is not None or not sync else 10,
                seconds=round(late, 3),
                run_id=run_id,
            )
        self._blocked = None
        self._turned = now
        self._tick_due = now + TICK
        if self.loop is not None and not self.loop.is_closed():
            self._ticker = self.loop.call_later(TICK, self._tick)

    def check_lag(self, now: float) -> None:
        """From the keeper's thread: log, once per stall, the async run whose code holds the
        loop (`loop_blocked`). A stall with no async handler's task on the loop (a sync
        handler run inline, or leasework's own statements of a poll) is no blocking call in an
        async handler: logged at DEBUG (`loop_busy`), with the sync run if one is running."""
        if not self.serving or self._blocked is not None or now - self._turned < LAG_WARN + TICK:
            return
        loop = self.loop
        task = None
        if loop is not None:
            with suppress(Exception):
                task = asyncio.current_task(loop)  # a dict read: safe from another thread
        ctx = (
            None
            if task is None
            else next((c for c in list(self.running.values()) if c.task is task), None)
        )
        seconds = round(now - self._turned, 3)
        if ctx is None:
            self._blocked = (None, now)
            sync = self.executor.current
            log.event(
                "loop_busy",
                level=10,
                sync_run_id=None if sync is None else sync.claim.id,
                async_runs_waiting=len(self.running),
                seconds=seconds,
            )
            return
        self._blocked = (ctx.claim.id, now)
        log.event(
            "loop_blocked",
            level=30,
            run_id=ctx.claim.id,
            kind=ctx.claim.kind,
            seconds=seconds,
            hint="a synchronous call in an async handler stops every run of this worker: await "
            "it, or run it with asyncio.to_thread",
        )

    async def apool(self) -> AsyncConnectionPool[Any]:
        """The async pool for handlers (pool_size - 1 connections at most), opened on first use."""
        if self._apool is None:
            cfg = self.config
            pool = db.make_async_pool(
                cfg.dsn, cfg.pool_size - 1, f"leasework:{self.worker_id}", pooler=cfg.pooler
            )
            self._apool = pool
            await pool.open(wait=False)
        return self._apool

    def close(self) -> None:
        """Close the async pool and the loop (runs still in flight are cancelled first)."""
        loop = self.loop
        if loop is None or loop.is_closed() or loop.is_running():
            return
        for ctx in list(self.running.values()):
            ctx.signal.trip("shutdown")
            ctx.deliver()
        with suppress(Exception):
            self.run_pending()
        with suppress(Exception):
            self.seal()
        if self._apool is not None:
            with suppress(Exception):
                loop.run_until_complete(self._apool.close())
            self._apool = None
        with suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        self.loop = None

    # -- runs -----------------------------------------------------------------------------------

    def in_flight(self, kind: str | None = None) -> int:
        if kind is None:
            return len(self.running)
        return sum(1 for c in self.running.values() if c.claim.kind == kind)

    def ready(self) -> bool:
        """Does the stage have something to do at once: successes to seal, or room after a
        claim that filled its limit?"""
        return bool(self.done) or self.claim_more

    def start(self, claims: Sequence[Claim], handler_for: Callable[[str], Any]) -> int:
        """Start a task per claim (claimed in one statement): held by the keeper from the claim
        on, each handler's timeout counted from its start. Returns how many started."""
        if not claims:
            return 0
        loop = self.get_loop()
        self.keeper.hold_many(claims, sent=min(c.sent for c in claims))
        traced = tracing.AVAILABLE and tracing.enabled()
        spans = (
            dict(zip((c.id for c in claims), self.executor.run_spans(claims), strict=True))
            if traced
            else {}
        )
        started = 0
        for claim in claims:
            held = self.keeper.holding(claim)  # its block is the task's (_run)
            if held.signal.reason == "lost":
                # Its answer came after its lease could have run out (Keeper.hold): another
                # worker may hold it now. Never start it.
                with held:
                    log.event(
                        "claim_not_started", level=30, run_id=claim.id, owner=str(claim.owner)
                    )
                continue
            ctx = AsyncContext(claim, self, held)
            self.running[claim.id] = ctx
            log_claimed(claim, self.worker_id)
            ctx.task = loop.create_task(
                self._run(ctx, held, handler_for(claim.kind), spans.get(claim.id)),
                name=f"leasework-run-{claim.id}",
            )
            started += 1
        self.executor.beat(None)  # the supervisor knows the runs before their handlers start
        return started

    async def _run(
        self,
        ctx: AsyncContext,
        held: Held,
        handler: AsyncHandler,
        spans: tracing.RunSpans | None = None,
    ) -> None:
        """The run's task; with tracing on, within its spans (tracing.RunSpans: each task has its
        own copy of the context, so the run span is current for its handler only)."""
        if spans is None:
            await self._attempt(ctx, held, handler, None)
            return
        with spans.run() as span:
            await self._attempt(ctx, held, handler, (spans, span))

    async def _attempt(
        self,
        ctx: AsyncContext,
        held: Held,
        handler: AsyncHandler,
        traced: tuple[tracing.RunSpans, Any] | None,
    ) -> None:
        claim = ctx.claim
        returned: Any = None
        raised: BaseException | None = None
        fatal: BaseException | None = None  # KeyboardInterrupt, SystemExit: give the run back
        # The handler's own `logging` records carry the run (log.RunFormatter); each task has a
        # copy of the context, so runs never see each other's.
        token = log.RUN.set({"run_id": claim.id, "kind": claim.kind, "attempt": claim.attempts})
        try:
            with held:  # then no longer held: the keeper must not take the write for a lost lease
                try:
                    returned = await handler(ctx, claim.payload)
                except asyncio.CancelledError:
                    if not ctx.signal.tripped:  # not ours: the loop is closing under the run
                        ctx.signal.trip("shutdown")
                    raised = Aborted(ctx.signal.reason or "shutdown")
                    task = asyncio.current_task()
                    if task is not None:
                        task.uncancel()
                except Exception as exc:
                    raised = exc
                except BaseException as exc:
                    ctx.signal.trip("shutdown")
                    raised = fatal = exc
                finally:
                    # A task closed unfinished by the garbage collector ends in another context.
                    with suppress(ValueError):
                        log.RUN.reset(token)
            # Successes wait in `done` for the stage's next step, which seals them together.
            if traced is None:
                self.completer.conclude(ctx, returned, raised, defer=self.done)
            else:
                with traced[0].seal():
                    status = self.completer.conclude(ctx, returned, raised, defer=self.done)
                traced_end(*traced, status, raised)
            if fatal is not None:
                raise fatal
        finally:
            self.running.pop(claim.id, None)
            self.executor.jobs_done += 1
            self.changed.set()

    def interrupt(self, held: Held) -> bool:
        """From the keeper's thread: cancel the run's task on the loop, if it is one of ours."""
        ctx = self.running.get(held.claim.id)
        loop = self.loop
        if ctx is None or loop is None:
            return False
        with suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(ctx.deliver)
        return True

    def wake(self) -> None:
        """Wake the worker's loop from its wait (a stop asked from a signal handler)."""
        loop = self.loop
        if self.serving and loop is not None:
            with suppress(RuntimeError):
                loop.call_soon_threadsafe(self.changed.set)

    def stop_all(self, reason: str) -> None:
        """Trip every run in flight (a fast stop); the keeper's next tick interrupts them."""
        for ctx in list(self.running.values()):
            ctx.signal.trip(reason)

    def seal(self) -> int:
        """Seal the successes waiting, in one owner-scoped statement. Returns how many."""
        if not self.done:
            return 0
        done, self.done = self.done, []
        self.completer.seal_successes(done)
        return len(done)

    def run_pending(self) -> None:
        """Outside the worker's loop (a test, `Worker.poll()` called directly): run the loop until
        every run in flight has ended."""
        loop = self.get_loop()
        if loop.is_running():
            return
        while self.running:
            tasks = [c.task for c in self.running.values() if c.task is not None]
            if not tasks:
                break
            loop.run_until_complete(asyncio.wait(tasks))

    def run_now(self, claim: Claim, handler: AsyncHandler) -> None:
        """Run one claimed run to its end and write its outcome (leasework.testing)."""
        self.start([claim], lambda kind: handler)
        self.run_pending()
        self.seal()
