"""One worker: `poll()` runs every stage once, in a fixed order, each bounded and wrapped in its
own try/except; `run()` is `while running: poll(); sleep`, woken early by NOTIFY. One sync job at
a time, run inline by the executor, its lease kept by the keeper whatever the handler does. With
an async stage (`async def` handlers) the same loop runs on an asyncio event loop, its waits
awaited, so that the async runs in flight go on between polls (workers/aexecutor.py). Opens its
connections itself, after any fork. Knows no stage: whoever builds it gives the list."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any, Protocol

import psycopg

from .. import db, log
from ..config import Config
from ..errors import ConfigError, gave_up_on_lock, is_transient
from . import idle, presence
from .aexecutor import AsyncExecutor
from .connections import Connections
from .context import Context, describe_error
from .deadman import Deadman
from .executor import Executor
from .keeper import Held, Keeper
from .stage import Site, Stage

# Sent by the keeper's thread to the main thread to interrupt a handler whose run must stop.
INTERRUPT_SIGNAL = signal.SIGUSR2


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
        self.on_beat = on_beat
        self.running = False
        self._stop_at: float | None = None  # monotonic time the current job must be aborted by
        self._draining = False  # stop claiming, but let the job in hand finish with no deadline
        self._handled: dict[str, int] = {}  # stage name -> what it handled in the last poll
        self._idle_until: dict[str, float] = {}  # stage name -> monotonic time to ask it again
        # Stages whose last step gave up on a lock another session holds: logged at warning once,
        # then at debug while it lasts (it is tried again every poll).
        self._held_back: set[str] = set()
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
        self._main_ident: int | None = None
        self._old_interrupt_handler: Any = None

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
        self._install_interrupt()
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
        if self._main_ident is not None and threading.get_ident() == self._main_ident:
            signal.signal(INTERRUPT_SIGNAL, self._old_interrupt_handler or signal.SIG_DFL)
            self._main_ident = None

    def __enter__(self) -> Worker:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- interrupting a handler -----------------------------------------------------------------

    def _install_interrupt(self) -> None:
        """The keeper interrupts a handler by sending INTERRUPT_SIGNAL to the main thread, where
        Python runs signal handlers; a worker built on another thread is never interrupted (its
        handlers see the abort at their next ctx.check())."""
        if (
            self._main_ident is not None
            or threading.current_thread() is not threading.main_thread()
        ):
            return
        self._old_interrupt_handler = signal.signal(
            INTERRUPT_SIGNAL, lambda signum, frame: self.interrupt_now()
        )
        self._main_ident = threading.get_ident()

    def _interrupt(self, held: Held) -> None:
        """From the keeper's thread: cancel an async run's task on the loop, or have the main
        thread raise Aborted in the sync handler."""
        if self.aexecutor.interrupt(held):
            return
        ident = self._main_ident
        if ident is not None and threading.get_ident() != ident:
            with suppress(ProcessLookupError, OSError):
                signal.pthread_kill(ident, INTERRUPT_SIGNAL)

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
        done = 0
        now = time.monotonic()
        if self.conns.wake.listen():  # before any statement: what they miss is heard
            skip_idle = False  # LISTENing only now (a reconnect): what it missed is anyone's
        wakes = self.conns.wake.can_wake
        for stage in self.stages:
            if self.stopping:
                break
            if skip_idle and now < self._idle_until.get(stage.name, 0.0):
                continue
            handled = 0
            due: float | None = 0.0  # unknown, unless the stage can tell
            try:
                handled = stage.step(self.site)
                if not handled:
                    due = self._next_due(stage)
            except Exception as exc:  # one failing stage never skips the ones after it
                if gave_up_on_lock(exc):
                    again = stage.name in self._held_back
                    self._held_back.add(stage.name)
                    log.event(
                        "lock_unavailable",
                        level=10 if again else 30,
                        stage=stage.name,
                        error=log.first_line(exc),
                    )
                else:
                    level = 30 if is_transient(exc) else 40
                    log.event(
                        "stage_failed", level=level, stage=stage.name, error=describe_error(exc, 3)
                    )
            else:
                self._held_back.discard(stage.name)
            done += handled
            self._handled[stage.name] = handled
            if handled:
                self._idle_until.pop(stage.name, None)
            else:
                cfg = self.config
                exact = bool(getattr(stage, "exact_due", False))
                rest = idle.rest(
                    due, cfg.poll_interval, cfg.idle_poll_max, wakes=wakes, exact=exact
                )
                self._idle_until[stage.name] = time.monotonic() + rest
        self.conns.wake.drain_notifies()
        self.beat(None)
        return done

    def _next_due(self, stage: Stage) -> float | None:
        """The stage's own answer (`Due.next_due`), or 0 (unknown: poll_interval) without one."""
        ask: Callable[[Site], float | None] | None = getattr(stage, "next_due", None)
        return 0.0 if ask is None else ask(self.site)

    def idle_timeout(self, now: float) -> float:
        """How long an idle wait may last (both run loops ask): until the first stage's rest
        ends, each resting until it is next due, at most idle_poll_max (workers/idle.py)."""
        rests = [self._idle_until.get(s.name, now) for s in self.stages]
        return idle.timeout(now, rests, self.config.poll_interval)

    def others_due(self, name: str) -> bool:
        """Is a stage other than `name` due: not resting, or asked for by a NOTIFY?"""
        now, rest = time.monotonic(), self._idle_until
        due = any(s.name != name and now >= rest.get(s.name, 0.0) for s in self.stages)
        return due or any(self.stage_for(p) not in (None, name) for p in self.conns.wake.woken)

    def run(self, *, once: bool = False) -> None:
        """Poll until stopped. Does not sleep after a poll that found work; an idle sleep wakes
        at once on a NOTIFY from enqueue (polling stays the fallback)."""
        self.open()
        self.running = True
        log.event(
            "worker_started",
            worker=self.id,
            pid=os.getpid(),
            stages=[s.name for s in self.stages],
            pool=self.pool,
        )
        try:
            if self.asynchronous:
                self.aexecutor.serve(self._serve(once))
                return
            skip_idle = False
            while self.running:
                found = self._poll_safely(skip_idle)
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
                skip_idle = self._wake(woken) or skip_idle
        finally:
            self.running = False
            log.event("worker_stopped", worker=self.id, jobs=self.jobs_done)
            self.close()

    async def _serve(self, once: bool) -> None:
        """`run()`'s loop on the event loop: the async runs in flight go on while it waits. It
        waits for a NOTIFY, a run ending or the poll interval; it polls again at once while the
        async stage has successes to seal or may claim more. Stopping, it claims nothing more
        and returns once every run in flight has ended (finished, or released at the graceful
        deadline) and been sealed."""
        ax = self.aexecutor
        skip_idle = False
        while self.running or ax.in_flight() or ax.done:
            found = self._poll_safely(skip_idle) if self.running else self._seal_safely()
            if once and not self.stopping:
                self.drain()  # one poll's claims, then its runs to their end
            skip_idle = found > 0
            asynchronous = {s.name for s in self.stages if getattr(s, "asynchronous", False)}
            others = sum(n for name, n in self._handled.items() if name not in asynchronous)
            if ax.ready() or (others and self.running):
                # More to do at once: successes to seal, room after a full claim, or a sync
                # stage that found work (as run()'s loop, it polls again without waiting). The
                # runs just started take their first step meanwhile.
                await asyncio.sleep(0)
                woken = self.conns.wake.take_woken()
            else:
                ax.changed.clear()
                wait = self.idle_timeout(time.monotonic())
                woken = await self.conns.wake.idle_wait_async(wait, ax.changed)
                if ax.changed.is_set():  # a run ended: its stage seals it (and claims anew)
                    for stage in self.stages:
                        if getattr(stage, "asynchronous", False):
                            self._idle_until.pop(stage.name, None)
                    skip_idle = True
            skip_idle = self._wake(woken) or skip_idle

    def _poll_safely(self, skip_idle: bool) -> int:
        try:
            return self.poll(skip_idle=skip_idle)
        except Exception as exc:  # poll() already isolates stages; this is belt and braces
            log.event("poll_failed", level=40, error=describe_error(exc, 3))
            return 0

    def _seal_safely(self) -> int:
        try:
            return self.aexecutor.seal()
        except Exception as exc:
            log.event("seal_failed", level=40, error=describe_error(exc, 3))
            return 0

    def _wake(self, woken: set[str]) -> bool:
        """Woken by a NOTIFY naming a kind: ask its stage at once and leave the stages polled a
        moment ago for their next turn (pickup latency, bench/README.md). Whether any was."""
        asked = False
        for stage in {self.stage_for(p) for p in woken}:
            if stage is not None:
                self._idle_until.pop(stage, None)
                asked = True
        return asked

    @property
    def asynchronous(self) -> bool:
        """Whether this worker runs an event loop: a stage of it runs async handlers of kinds
        its pool claims."""
        return any(
            getattr(stage, "asynchronous", False) and any(map(self.serves, stage.wakes))
            for stage in self.stages
        )

    def serves(self, kind: str) -> bool:
        """Whether this worker claims `kind` (its pool's rule; every kind without a pool)."""
        return self.config.pool_serves(self.pool, kind)

    def stage_for(self, payload: str | None) -> str | None:
        """The stage a NOTIFY's payload wakes (a task kind, or `upload`); None if none does, or
        if it names a kind this worker's pool does not claim."""
        if payload is None or not self.serves(payload):
            return None
        for stage in self.stages:
            if payload in stage.wakes:
                return stage.name
        return None

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
