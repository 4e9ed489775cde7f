"""One worker: `poll()` runs every stage once (workers/poller.py); `run()` is `while running:
poll(); sleep`, woken early by NOTIFY. One sync job at a time, run inline by the executor, its
lease kept by the keeper whatever the handler does. With an async stage (`async def` handlers)
the loop is workers/aworker.py's, on an asyncio event loop. Opens its connections itself, after
any fork. Knows no stage: whoever builds it gives the list."""

from __future__ import annotations

import os
import random
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Protocol

import psycopg

from .. import db, log
from ..config import Config
from ..errors import ConfigError
from . import presence
from .aexecutor import AsyncExecutor
from .aworker import AsyncLoop
from .connections import Connections
from .context import Context, describe_error
from .deadman import Deadman
from .executor import Executor
from .interrupt import MainThread
from .keeper import Held, Keeper
from .poller import Poller
from .stage import Site, Stage


class Application(Protocol):
    """What a worker (and the supervisor that forks it) needs of the app it serves: its
    settings, its stage list, and itself under other settings."""

    config: Config

    def stages(self, config: Config) -> list[Stage]: ...

    def with_config(self, config: Config) -> Application: ...


def new_worker_id() -> str:
    """Unique per process start, never reused: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Worker:
    def __init__(
        self,
        app: Application,
        config: Config | None = None,
        *,
        worker_id: str | None = None,
        stages: Sequence[Stage] | None = None,
        on_beat: Callable[[Worker, Context | None], None] | None = None,
        rand: random.Random | None = None,
        register: bool = True,
        deadman: bool = False,
        keeper_thread: bool = True,
        pool: str | None = None,
    ) -> None:
        self.app = app
        self.config = config or app.config
        self.id = worker_id or new_worker_id()
        # A pool (config `pools`) claims only its kinds; None: every kind of the app.
        self.pool = pool
        if pool is not None:
            self.config.pool(pool)  # an unknown pool is a ConfigError here, before any claim
        self.stages: list[Stage] = list(stages) if stages is not None else app.stages(self.config)
        self.poller = Poller(self)
        self.on_beat = on_beat
        self.running = False
        self._stop_at: float | None = None  # monotonic time the current job must be aborted by
        self._draining = False  # stop claiming, but let the job in hand finish with no deadline
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
            on_tick=self._ticked,
        )
        self.conns = Connections(self.config, self.id, lambda p: self.stage_for(p) is not None)
        self.executor = Executor(
            self.config,
            worker_id=self.id,
            keeper=self.keeper,
            conns=self.conns,
            beat=self.beat,
            stopping=lambda: self.stopping,
            rand=rand,
        )
        self.aexecutor = AsyncExecutor(self.executor)
        site = (self.id, self.config, self.conns, self.executor, lambda: self.stopping)
        self.site = Site(*site, self.others_due, self.serves, self.aexecutor, pool)
        self._want_deadman = deadman
        self._keeper_thread = keeper_thread
        self._main = MainThread()  # where a sync handler is interrupted (workers/interrupt.py)

    @property
    def current(self) -> Context | None:
        """The context of the run whose handler is running, if any."""
        return self.executor.current

    @property
    def jobs_done(self) -> int:
        return self.executor.jobs_done

    # -- opening and closing --------------------------------------------------------------------

    def open(self) -> Worker:
        """Connections (a bad database fails in one line), the dead man's switch, the interrupt
        signal, the first heartbeat, the keeper's thread."""
        self.conns.open()
        if self._want_deadman and self.keeper.deadman is None:
            self.keeper.deadman = Deadman()
        self._main.install(self.interrupt_now)
        self.heartbeat(force=True)
        if self._keeper_thread:
            self.keeper.start()
        return self

    def close(self) -> None:
        self.aexecutor.close()
        if self.register and self._last_heartbeat is not None:
            with suppress(psycopg.Error, db.DatabaseUnavailable, ConfigError):
                # A clean exit removes its row: a stopped worker is not a "gone" one.
                self.keeper.run(lambda c: presence.remove_worker(c, self.id))
        self.keeper.close()
        self.conns.close()
        self._main.restore()

    def __enter__(self) -> Worker:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- interrupting a handler -----------------------------------------------------------------

    def _interrupt(self, held: Held) -> None:
        """From the keeper's thread: cancel an async run's task on the loop, or have the main
        thread raise Aborted in the sync handler."""
        if not self.aexecutor.interrupt(held):
            self._main.send()

    def interrupt_now(self) -> None:
        """In the main thread (a signal handler): raise Aborted into the running handler now."""
        ctx = self.current
        if ctx is not None:
            ctx.interrupt()

    # -- liveness -------------------------------------------------------------------------------

    def _ticked(self, keeper: Keeper) -> None:
        """After each of the keeper's ticks (its thread): liveness, and a blocked event loop."""
        self.aexecutor.check_lag(time.monotonic())
        self.beat(self.current)

    def beat(self, ctx: Context | None) -> None:
        """Liveness, after each poll, run, ctx.check() and keeper tick; the supervisor listens."""
        if self.register:  # a standalone worker's own row (under the supervisor, the parent's)
            self.heartbeat()
        if self.on_beat is not None:
            self.on_beat(self, ctx)

    def heartbeat(self, force: bool = False, now: float | None = None) -> None:
        """Upsert this worker's row every heartbeat_interval (standalone workers only)."""
        if not self.register:
            return
        now = time.monotonic() if now is None else now
        last = self._last_heartbeat
        if not force and last is not None and now - last < self.config.heartbeat_interval:
            return
        self._last_heartbeat = now
        held = self.keeper.most_urgent()[0]
        run_id = held.claim.id if held is not None else None
        host, pid = socket.gethostname(), os.getpid()
        try:
            # On the keeper's connection: it beats from the keeper's thread while a handler runs.
            self.keeper.run(
                lambda c: presence.upsert_worker(
                    c, self.id, host, pid, run_id, presence.pool_of(self.config, self.pool)
                )
            )
        except (psycopg.Error, db.DatabaseUnavailable, ConfigError) as exc:
            log.event("heartbeat_failed", level=30, error=log.first_line(exc))

    # -- the loop -------------------------------------------------------------------------------

    def poll(self, *, skip_idle: bool = False) -> int:
        """Run every stage once, in order; how many items they handled. skip_idle (`run()`,
        between back-to-back polls): a stage that found nothing rests until poll_interval has
        passed, so a busy queue does not pay every idle stage's queries per batch."""
        if self.conns.wake.listen():  # before any statement: what they miss is heard
            skip_idle = False  # LISTENing only now (a reconnect): what it missed is anyone's
        done = self.poller.poll(skip_idle=skip_idle, wakes=self.conns.wake.can_wake)
        self.conns.wake.drain_notifies()
        self.beat(None)
        return done

    def idle_timeout(self, now: float) -> float:
        """How long an idle wait may last (both run loops ask): Poller.idle_timeout."""
        return self.poller.idle_timeout(now)

    def others_due(self, name: str) -> bool:
        """Is a stage other than `name` due: not resting, or asked for by a NOTIFY?"""
        return self.poller.others_due(name, self.conns.wake.woken)

    def run(self, *, once: bool = False) -> None:
        """Poll until stopped. Does not sleep after a poll that found work; an idle sleep wakes
        at once on a NOTIFY from enqueue (polling stays the fallback)."""
        self.open()
        self.running = True
        stages = [s.name for s in self.stages]
        log.event("worker_started", worker=self.id, pid=os.getpid(), stages=stages, pool=self.pool)
        try:
            if self.asynchronous:
                self.aexecutor.serve(AsyncLoop(self).run(once))
                return
            skip_idle = False
            while self.running:
                found = self.poll_safely(skip_idle)
                if once:
                    break
                skip_idle = found > 0
                if found == 0 and self.running:
                    wait = self.idle_timeout(time.monotonic())
                    woken = self.conns.wake.idle_wait(wait, stop=lambda: not self.running)
                    # Then only the stages whose rest is over or that a NOTIFY named; every
                    # stage after one naming none (the supervisor's fast release).
                    skip_idle = not self.conns.wake.stray
                else:
                    woken = self.conns.wake.take_woken()
                skip_idle = self.poller.wake(woken) or skip_idle
        finally:
            self.running = False
            log.event("worker_stopped", worker=self.id, jobs=self.jobs_done)
            self.close()

    def poll_safely(self, skip_idle: bool) -> int:
        try:
            return self.poll(skip_idle=skip_idle)
        except Exception as exc:  # poll() already isolates stages; this is belt and braces
            log.event("poll_failed", level=40, error=describe_error(exc, 3))
            return 0

    @property
    def asynchronous(self) -> bool:
        """Whether this worker runs an event loop (workers/aworker.py): Poller.asynchronous."""
        return self.poller.asynchronous

    def serves(self, kind: str) -> bool:
        """Whether this worker claims `kind` (its pool's rule; every kind without a pool)."""
        return self.config.pool_serves(self.pool, kind)

    def stage_for(self, payload: str | None) -> str | None:
        """The stage a NOTIFY's payload wakes (Poller.stage_for)."""
        return self.poller.stage_for(payload)

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
        if not graceful:
            self.aexecutor.stop_all("shutdown")
        self.keeper.wake()
        self.aexecutor.wake()

    def drain(self) -> None:
        """Stop claiming after the job in hand, which finishes with no deadline (recycling a
        child after max_jobs_per_child). Every stage checks `stopping` before it claims."""
        self.running = False
        self._draining = True
        self.aexecutor.wake()

    @property
    def stopping(self) -> bool:
        return self._draining or self._stop_at is not None
