"""The lease keeper: renews every lease the worker holds and runs the control query, on a thread
and a connection of its own, whatever the handler is doing (a blocking sleep, a socket read,
`subprocess.run`, an open `ctx.transaction()`, a C call that releases the GIL). When a run must
stop (cancel requested, lease lost, timed out, shutting down) it trips the run's abort signal
and interrupts the main thread, which raises `Aborted` in the handler.

`tend()` does whatever is due, under one lock: the keeper's thread calls it on its own schedule
and `ctx.check()` calls it too (without waiting for the lock), so a handler that does call
`ctx.check()` sees a cancel at once. Never runs job code; writes only through lease.py; never
touches the worker's other connections, so an interrupted handler cannot corrupt it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from .. import db, log
from ..config import Config, LeaseTiming, lease_timing
from ..errors import LeaseworkError, is_transient
from ..leases import lease
from ..leases.lease import Claim
from .deadman import Deadman

Conn = psycopg.Connection[Any]

# A renewal that has failed for this share of the lease trips `lost`, before the lease could
# have expired in database time (the renewal's `now()` is never earlier than our sending it).
GIVE_UP_AT = 0.9
# The dead man's switch fires this long after the parent's watchdog would have killed the child
# (the parent records the outcome, so it should act first), and this long after the abort grace.
DEADMAN_SLACK = 2.0


class AbortSignal:
    """Run timeout, lost lease, cancel and shutdown all trip this one signal; the first reason
    wins. Handlers listen to one thing: `ctx.check()` raises `Aborted(reason)` once tripped."""

    __slots__ = ("reason",)

    def __init__(self) -> None:
        self.reason: str | None = None

    def trip(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    @property
    def tripped(self) -> bool:
        return self.reason is not None


@dataclass(eq=False)
class Held:
    """A claimed run the keeper looks after, from its claim until its outcome is written.
    Times are this process's monotonic clock. As a context manager (Keeper.holding), the block's
    end stops the keeper looking after it."""

    claim: Claim
    timing: LeaseTiming  # its lease's: how often it is renewed and its state read
    renewed: float  # when the last renewal that landed was sent (the claim counts as one)
    controlled: float  # when the run's state was last read
    signal: AbortSignal = field(default_factory=AbortSignal)
    executing: bool = False  # its handler is running (a batch holds runs not started yet)
    started: float | None = None
    deadline: float | None = None  # when the attempt times out
    tripped_at: float | None = None  # when the signal tripped while executing
    interrupted: bool = False
    keeper: Keeper | None = field(default=None, repr=False)

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.keeper is not None:
            self.keeper.drop(self.claim.id)


class Keeper:
    def __init__(
        self,
        config: Config,
        *,
        name: str,
        stop_at: Callable[[], float | None] = lambda: None,
        interrupt: Callable[[Held], None] | None = None,
        on_tick: Callable[[Keeper], None] | None = None,
        deadman: Deadman | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.name = name
        self._stop_at = stop_at
        self._interrupt = interrupt
        self._on_tick = on_tick
        self.deadman = deadman
        self._clock = clock
        self._lock = threading.RLock()
        self._held: dict[int, Held] = {}
        # The held runs whose handlers run (one for sync handlers, several async): what a beat
        # asks for after each claim (most_urgent), without walking the runs a batch holds but
        # has not started.
        self._executing: dict[int, Held] = {}
        self._conn: Conn | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_at = float("inf")  # when the thread's current wait ends
        # No renewal or control query is due before this (kept by hold and _query), so that
        # `due()` answers without walking every held run: a batch asks before each of its runs.
        self._next_check = float("inf")
        self._closing = False
        self.timing = lease_timing(config)  # the worker's own; a run's is scaled to its lease
        self._timings_by_lease: dict[float, LeaseTiming] = {}

    # -- what the worker tells it ---------------------------------------------------------------

    def hold(
        self, claim: Claim, now: float | None = None, *, sent: float | None = None, arm: bool = True
    ) -> Held:
        """Look after a claimed run's lease from now on. The claim was its first renewal, made
        when the claim statement was `sent` (default: now). A claim whose answer came so late
        that a renewal is already due is confirmed at once, before the dead man's switch counts
        on it: renewed if still ours, tripped `lost` if not (its caller must then not start it;
        another worker may have reclaimed it after its lease ran out)."""
        now = self._clock() if now is None else now
        timing = self.timing_of(claim.lease_seconds)
        since = now if sent is None else min(now, sent)
        held = Held(claim, timing, renewed=since, controlled=since, keeper=self)
        with self._lock:
            self._held[claim.id] = held
            if now - held.renewed >= held.timing.renew:
                self._query([held])
            if arm:
                self._arm(now)
            due = min(held.controlled + held.timing.control, held.renewed + held.timing.renew)
            self._next_check = min(self._next_check, due)
            self._changed(due)
        return held

    def timing_of(self, lease_seconds: float) -> LeaseTiming:
        """The timings of a run with this lease (lease_timing; kept per lease: asked per run)."""
        timing = self._timings_by_lease.get(lease_seconds)
        if timing is None:
            timing = lease_timing(self.config, lease_seconds)
            self._timings_by_lease[lease_seconds] = timing
        return timing

    def hold_many(self, claims: Sequence[Claim], *, sent: float) -> None:
        """`hold` for every run of a batch, in one pass under the lock: the runs claimed by one
        statement share its send time, so a late answer is confirmed for all of them in one
        statement, their next check falls due together, and the dead man's switch is armed once
        (arming walks every held run)."""
        with self._lock:
            now = self._clock()
            since = min(now, sent)
            held_runs = self._held
            batch: list[Held] = []
            for claim in claims:
                timing = self.timing_of(claim.lease_seconds)
                held = Held(claim, timing, renewed=since, controlled=since, keeper=self)
                held_runs[claim.id] = held
                batch.append(held)
            late = [h for h in batch if now - since >= h.timing.renew]
            if late:
                self._query(late)
            self._arm(now)
            if batch:
                due = min(
                    min(h.controlled + h.timing.control, h.renewed + h.timing.renew) for h in batch
                )
                self._next_check = min(self._next_check, due)
                self._changed(due)

    def due(self, now: float) -> bool:
        """Might `tend` have anything to do (a renewal or control query due, or shutdown)? No
        executing run is counted: asked between the runs of a batch."""
        stop_at = self._stop_at()
        return now >= self._next_check or (stop_at is not None and now >= stop_at)

    def holding(self, claim: Claim) -> Held:
        """A run's attempt, from the keeper's side: `with keeper.holding(claim) as held:` holds
        the claim (unless held already: a batch's, Keeper.hold_many) and starts its attempt
        (`begin`) unless it was found lost, when its caller must not start it; the block's end
        stops looking after it (`drop`), before its outcome is written, which the keeper must not
        take for a lost lease."""
        held = self._held.get(claim.id) or self.hold(claim, sent=claim.sent)
        if held.signal.reason != "lost":
            self.begin(held)
        return held

    def begin(self, held: Held, now: float | None = None) -> None:
        """Its handler starts now: the attempt's timeout runs from here."""
        now = self._clock() if now is None else now
        with self._lock:
            held.executing = True
            self._executing[held.claim.id] = held
            held.started = now
            timeout = held.claim.timeout_seconds
            held.deadline = None if timeout is None else now + timeout
            if held.deadline is not None and self.deadman is not None:
                # The deadline is one more candidate of kill_at's minimum: it can only bring the
                # switch forward, so it is armed only if it falls before the time armed. Arming
                # walks every held run: at each start of a batch's run (every run's default
                # timeout is an hour), a walk of the batch per run.
                armed = self.deadman.armed_at
                cfg = self.config
                if armed is None or held.deadline + cfg.abort_grace + DEADMAN_SLACK < armed:
                    self._arm(now)
            self._changed(held.deadline)

    def drop(self, run_id: int) -> None:
        """The run's outcome is written (or it was lost): stop looking after it."""
        if run_id not in self._held:  # dropped already (a batch's run not started, a test)
            return
        with self._lock:
            self._held.pop(run_id, None)
            self._executing.pop(run_id, None)
            if not self._held:
                self._next_check = float("inf")  # else the next run held would find it due
                self._arm(self._clock(), idle_later=True)

    def get(self, run_id: int) -> Held | None:
        return self._held.get(run_id)

    def executing(self) -> Held | None:
        return next(iter(list(self._executing.values())), None)

    def most_urgent(self) -> tuple[Held | None, int]:
        """The executing run the supervisor's watchdog must watch, and how many runs execute.
        With several (async handlers), the one whose deadline comes first: its lease, less the
        watchdog's margin, since its last renewal; its abort grace once its run must stop; its
        timeout's. The parent checks that one run's figures; nothing changes while a child is
        frozen, so the first deadline of its last beat is the first of all its runs."""
        runs = list(self._executing.values())
        # A sync handler's run (a beat per run of a batch): the one, whatever its times.
        if len(runs) < 2:
            return (runs[0] if runs else None), len(runs)
        cfg = self.config
        best: Held | None = None
        best_at = float("inf")
        count = 0
        for held in runs:
            count += 1
            at = held.renewed + held.timing.unrenewed_max
            if held.tripped_at is not None:
                at = min(at, held.tripped_at + cfg.abort_grace)
            elif held.signal.tripped:
                at = float("-inf")  # tripped a moment ago: it must be reported now
            if held.deadline is not None:
                at = min(at, held.deadline + cfg.abort_grace)
            if best is None or at < best_at:
                best, best_at = held, at
        return best, count

    def executing_runs(self) -> list[Held]:
        """Every run whose handler is running (several only with async handlers)."""
        return list(self._executing.values())

    def wake(self) -> None:
        self._wake.set()

    def _changed(self, due: float | None) -> None:
        """Something is due at `due`: wake the thread if it would sleep past it. Back-to-back
        runs do not wake it at all (its next tick is due sooner), which keeps one-at-a-time
        throughput free of a thread switch per run. Called under the lock, as the thread sets
        `_wake_at` under it, so a change is never missed between the two."""
        if self._thread is not None and due is not None and due < self._wake_at:
            self._wake.set()

    # -- the tick -------------------------------------------------------------------------------

    def tend(self, now: float | None = None, *, wait: bool = True) -> None:
        """Do what is due: trip timeouts and shutdown, renew the leases due for renewal and read
        every held run's state (one statement), arm the dead man's switch, interrupt a handler
        whose run must stop. With wait=False, return at once if the thread is at it already."""
        if not self._lock.acquire(blocking=wait):
            return
        try:
            now = self._clock() if now is None else now
            runs = list(self._held.values())
            stop_at = self._stop_at()
            for held in runs:
                if held.executing and held.deadline is not None and now >= held.deadline:
                    self._trip(held, "timeout", now)
                elif stop_at is not None and now >= stop_at:
                    self._trip(held, "shutdown", now)
            alive = [h for h in runs if h.signal.reason != "lost"]
            if any(
                now - h.controlled >= h.timing.control or now - h.renewed >= h.timing.renew
                for h in alive
            ):
                self._query(alive)
            else:
                # Nothing was due after all (the runs that made `due()` true were dropped
                # meanwhile): `due()` must not stay true, or a batch tends before every run.
                self._next_check = self._earliest_check()
            self._arm(self._clock())
            for held in runs:
                if held.executing and held.signal.tripped:
                    if held.tripped_at is None:
                        held.tripped_at = now
                    if not held.interrupted and self._interrupt is not None:
                        held.interrupted = True
                        self._interrupt(held)
        finally:
            self._lock.release()

    def _query(self, runs: list[Held]) -> None:
        sent = self._clock()
        due = [(h.claim, sent - h.renewed >= h.timing.renew) for h in runs]
        try:
            # A lease that ran out is lost (tend_leases): even unclaimed, the limiter may have
            # let its tenant run another, so it is never renewed back to life.
            states = lease.tend(self._connection(), due)
        except (psycopg.Error, LeaseworkError) as exc:
            self._failed(runs, exc, sent)
            return
        for held in runs:
            if self._held.get(held.claim.id) is not held:
                continue  # dropped meanwhile: its outcome is being written
            state = states.get(held.claim.id)
            if state is None or not state.ours:
                self._lost(held, "the keeper found the run no longer ours", sent)
                continue
            held.controlled = sent
            if state.renewed:
                held.renewed = sent
            if state.cancel_requested and not held.signal.tripped:
                self._trip(held, "cancelled", sent)
                log.event("cancel_seen", run_id=held.claim.id)
        self._next_check = self._earliest_check()

    def _earliest_check(self) -> float:
        """When the first renewal or control query of a held run falls due (under the lock)."""
        return min(
            (
                min(h.controlled + h.timing.control, h.renewed + h.timing.renew)
                for h in self._held.values()
                if h.signal.reason != "lost"
            ),
            default=float("inf"),
        )

    def _failed(self, runs: list[Held], exc: BaseException, now: float) -> None:
        """A renewal or control query failed. Keep going while each lease is surely still ours;
        trip `lost` before it could have expired in database time."""
        level = 30 if is_transient(exc) or isinstance(exc, LeaseworkError) else 40
        log.event(
            "lease_check_failed",
            level=level,
            run_ids=[h.claim.id for h in runs],
            error=log.first_line(exc),
        )
        self._drop_connection()
        for held in runs:
            if now - held.renewed >= held.claim.lease_seconds * GIVE_UP_AT:
                self._lost(held, "renewal failed until the lease ran out", now)

    def _lost(self, held: Held, why: str, now: float) -> None:
        if held.signal.reason == "lost":
            return
        held.signal.reason = "lost"  # a lost lease overrides every other reason: write nothing
        if held.executing and held.tripped_at is None:
            held.tripped_at = now
        log.event("lease_lost", run_id=held.claim.id, owner=str(held.claim.owner), why=why)

    def _trip(self, held: Held, reason: str, now: float) -> None:
        if held.signal.tripped:
            return
        held.signal.trip(reason)
        if held.executing:
            held.tripped_at = now

    # -- the dead man's switch ------------------------------------------------------------------

    def kill_at(self, now: float) -> float | None:
        """When this process must be dead unless the keeper does better: before any held lease
        it could not confirm expires, and after a tripped (or timed-out) handler's abort grace."""
        cfg = self.config
        times: list[float] = []
        for held in list(self._held.values()):
            # Lost or not: a handler still running when the lease it last renewed runs out could
            # overlap the next attempt (a lost run's grace never outlasts its lease). A lost run
            # that has not started runs nothing: it is never started.
            if held.signal.reason == "lost" and not held.executing:
                continue
            times.append(held.renewed + held.timing.kill_after)
            if held.executing and held.tripped_at is not None:
                times.append(held.tripped_at + cfg.abort_grace + DEADMAN_SLACK)
            if held.executing and held.deadline is not None:  # even if no tick can trip it
                times.append(held.deadline + cfg.abort_grace + DEADMAN_SLACK)
        return min(times) if times else None

    def _arm(self, now: float, *, idle_later: bool = False) -> None:
        """Set the dead man's switch to kill_at, with two economies that spare one-at-a-time
        mode two timer syscalls per run (README, Performance):
        - a later deadline re-arms only when it is later by more than 5 % of the time left (at
          most watchdog_margin/4): the switch may fire that much early, and only if no renewal
          re-arms it first, which each does (a renewal moves it by renew_interval);
        - with `idle_later` (the last run was just dropped) an arming far off is left for the
          keeper's thread to disarm at its next wake, which comes long before it: the next run,
          claimed within milliseconds, re-arms it instead."""
        if self.deadman is None:
            return
        at = self.kill_at(now)
        armed = self.deadman.armed_at
        if at is None:
            if armed is None:
                return
            if idle_later and self._thread is not None:
                wake = min(self.config.heartbeat_interval, self.timing.control)
                if armed - now > 2 * wake + 1.0:
                    self._changed(now + wake)
                    return
            self.deadman.disarm()
        elif armed is None or at < armed or at - armed > min(
            0.05 * (at - now), self.timing.margin / 4
        ):
            self.deadman.arm(at, now)

    # -- the thread and its connection ----------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._closing = False
            self._thread = threading.Thread(
                target=self._loop, name=f"{self.name}-keeper", daemon=True
            )
            self._thread.start()

    def _next_wake(self, now: float) -> float:
        """Seconds until something is due: a control query, a renewal, a timeout, shutdown.
        With nothing held, at most control_interval: a run held meanwhile is due no sooner than
        that after its claim (at the default lease), so `_changed` need not wake the thread for
        it. Otherwise one-at-a-time mode, where nothing is held while a seal and the next claim
        are in flight, woke the thread for every run (a thread switch per job)."""
        times = [now + min(self.config.heartbeat_interval, self.timing.control)]
        stop_at = self._stop_at()
        for held in list(self._held.values()):
            if held.signal.reason == "lost":
                continue
            times.append(held.controlled + held.timing.control)
            times.append(held.renewed + held.timing.renew)
            if held.deadline is not None:
                times.append(held.deadline)
            if stop_at is not None:
                times.append(stop_at)
            if held.tripped_at is not None and not held.interrupted:
                times.append(now)
        return max(0.0, min(times) - now)

    def _loop(self) -> None:
        while not self._closing:
            with self._lock:
                now = self._clock()
                timeout = self._next_wake(now)
                self._wake_at = now + timeout
            self._wake.wait(timeout)
            self._wake_at = float("-inf")  # awake: nothing needs to wake it
            self._wake.clear()
            if self._closing:
                break
            try:
                self.tend()
                if self._on_tick is not None:
                    self._on_tick(self)
            except Exception as exc:  # the keeper must outlive any bug of a tick
                log.event("keeper_failed", level=40, error=log.first_line(exc))
                time.sleep(0.1)

    def connection(self) -> Conn:
        """The keeper's own connection (reopened if it broke). Bounded so that a cut-off
        database fails a statement within seconds instead of hanging the keeper."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._drop_connection()
            self._conn = db.connect(
                self.config.dsn,
                application_name=f"leasework:{self.name}:keeper",
                connect_timeout=db.HANG_CONNECT_TIMEOUT,
                pooler=self.config.pooler,
                **db.HANG_GUARD,
            )
            db.bound_waits(self._conn, self.config.lock_timeout, self.config.statement_timeout)
        return self._conn

    _connection = connection

    def run(self, fn: Callable[[Conn], Any]) -> Any:
        """Run `fn` on the keeper's connection, under its lock (the workers-row heartbeat)."""
        with self._lock:
            try:
                return fn(self.connection())
            except psycopg.Error:
                self._drop_connection()
                raise

    def _drop_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        with self._lock:
            self._drop_connection()
        if self.deadman is not None:
            self.deadman.close()
