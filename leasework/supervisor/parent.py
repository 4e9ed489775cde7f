"""The supervisor: one parent per host that forks N single-threaded worker children, reaps and
restarts them with backoff, acts on signals, runs the watchdog and keeps the workers rows.

Process plumbing only: it never runs job code and never claims a run. Its database use is the
`HostDB` (rows, fast release), whose connection is closed before every fork. Signal handlers
only record the signal; the loop acts on it (no logging or I/O inside a handler).
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import select
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

import psycopg

from .. import log
from ..config import lease_timing
from ..db import DatabaseUnavailable
from ..errors import is_transient
from ..leases.lease import RunRef
from ..workers import presence
from ..workers.worker import Application
from . import policy, wakeup
from .child import child_main
from .hostdb import HostDB, Killed, Row
from .liveness import Beat, Board, LineBuffer, latest
from .policy import Candidate, ExitMeaning, Liveness, Verdict
from .wakeup import Relay

if TYPE_CHECKING:
    from ..config import Config

HANDLED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGHUP,
    signal.SIGTTIN,
    signal.SIGTTOU,
    signal.SIGCHLD,
)
FAST_STOP_TIMEOUT = 3.0  # seconds children get after QUIT before SIGKILL
STOP_SLACK = 5.0  # beyond graceful_timeout: time to give the run back and close connections
TICK = 1.0  # the loop wakes at least this often
# A child's current run reaches its workers row at most this late, and the host's rows are written
# at most this often for it: a host finishing thousands of runs a second writes a few rows a second,
# not one per run (what `status` and the dashboard show; the watchdog reads the beats, not rows).
ROWS_CHANGE_GAP = 1.0
# The loop reads the children's beats at most this often (signals and the wake-up relay at once).
PASS_GAP = 0.02


@dataclass(eq=False)
class Slot:
    """A place for one child. `failures` is the slot's crash streak (restart backoff); `pool`
    the pool (config `pools`) whose kinds its child claims, None: every kind."""

    child: Forked | None = None
    failures: int = 0
    spawn_at: float = 0.0
    pool: str | None = None


@dataclass(eq=False)
class Forked:
    """A forked child as its parent knows it: its pid, its beat pipe and last beat, its workers
    row as last written, and whether and why it is being stopped (child.py is the child's own
    side)."""

    pid: int
    worker_id: str
    fd: int
    started: float
    generation: int
    slot: Slot | None  # None once retiring: it is stopping and will not be replaced
    last_beat: float
    buffer: LineBuffer = field(default_factory=LineBuffer)
    booted: bool = False
    beat: Beat | None = None
    error: str | None = None
    row_at: float | None = None  # when the parent last wrote this child's workers row
    row_run: int | None = None  # the current run that row shows
    watchdog_at: float | None = None  # when the watchdog sent QUIT
    killed: bool = False
    cancel_seen: tuple[int, float] | None = None  # (run id, when) the parent saw its cancel
    kill_run: Killed | None = None  # the run it was killed for, whose outcome the parent writes
    pool: presence.PoolRow = (None, None)  # its pool and kinds, as its workers row records them
    wake_fd: int = -1  # the parent's end of its wake pipe (wakeup.py), -1 without one
    board: Board | None = None  # its beat in shared memory (liveness.Board), written at once
    board_seq: int = 0  # the board's record last read

    def heard(self, beat: Beat) -> None:
        """Take `beat` as the child's state unless the one held is newer (a beat read from the
        board may be newer than the pipe's last line, never the other way round for long)."""
        if self.beat is None or beat.t >= self.beat.t:
            self.beat = beat

    def look(self, now: float) -> None:
        """Read the child's board: a change it wrote since the last reading (a new run, the
        last of a frozen child's claims) is its state, and the child was alive when it wrote
        it (its time, CLOCK_MONOTONIC, is the parent's clock too)."""
        if self.board is None:
            return
        read = self.board.read()
        if read is None or read[0] == self.board_seq:
            return
        self.board_seq, beat = read
        self.last_beat = max(self.last_beat, min(now, beat.t))
        self.heard(beat)

    @property
    def busy(self) -> bool:
        return self.beat is not None and self.beat.run_id is not None

    def current_run(self) -> int | None:
        return self.beat.run_id if self.beat else None

    def run_ref(self) -> RunRef | None:
        b = self.beat
        if b is None or b.run_id is None or b.owner is None:
            return None
        try:
            return RunRef(b.run_id, uuid.UUID(b.owner))
        except ValueError:
            return None

    def liveness(self) -> Liveness:
        b = self.beat
        if b is None:
            return Liveness(last_beat=self.last_beat)
        abort, abort_at = b.abort, b.abort_at
        seen = self.cancel_seen
        if abort is None and seen is not None and seen[0] == b.run_id:
            abort, abort_at = "cancelled", seen[1]
        return Liveness(self.last_beat, b.run_id, b.renewed, b.lease, b.timeout_at, abort, abort_at)

    def killed_for(self, reason: str) -> Killed | None:
        ref, b = self.run_ref(), self.beat
        if ref is None or b is None:
            return None
        return Killed(ref.id, ref.owner, b.attempt or 1, reason)


class Supervisor:
    def __init__(
        self,
        app: Application,
        config: Config,
        *,
        reload: Callable[[], Config] | None = None,
        rand: random.Random | None = None,
    ) -> None:
        # Construct before fork: nothing here touches the process or the database.
        self.app = app.with_config(config)
        self.config = config
        self.reload = reload
        self.rand = rand or random.Random()
        self.hostdb = HostDB(config)
        self.relay = Relay(config)
        self.slots: list[Slot] = []
        self.children: dict[int, Forked] = {}
        self.generation = 0
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._signals: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._wake_r = -1
        self._wake_w = -1
        self._booted = False  # schema checked
        self._cancels_at = float("-inf")  # when the children's runs were last checked for cancels
        self._rows_at = float("-inf")  # when the workers rows were last written
        self._passed_at = float("-inf")  # when the loop's last pass began
        self._boot_retry_at = 0.0
        self._boot_failures = 0
        self.stopping: str | None = None  # "graceful" or "fast"
        self._stop_deadline = 0.0
        self.exit_code = 0
        self.halt_message: str | None = None

    # -- signals ------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Only record it: logging here could deadlock on the logging lock (gunicorn b650332c).
        The wake-up fd (set_wakeup_fd) interrupts the loop's select."""
        self._signals.put_nowait(signum)

    def _install_signals(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
            os.set_inheritable(fd, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in HANDLED:
            signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        for sig in HANDLED:
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def _dispatch(self, signum: int, now: float) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            # The first asks for a graceful stop; a second one makes it fast.
            self.stop(graceful=self.stopping is None, now=now, why=policy.signal_name(signum))
        elif signum == signal.SIGQUIT:
            self.stop(graceful=False, now=now, why="SIGQUIT")
        elif signum == signal.SIGHUP:
            self._reload(now)
        elif signum in (signal.SIGTTIN, signal.SIGTTOU):
            why = policy.signal_name(signum)
            if self.config.pools:  # which pool would it mean? The file says, and SIGHUP reads it
                log.event("resize_ignored", level=30, why=why, note="pools: edit their processes")
            else:
                step = 1 if signum == signal.SIGTTIN else -1
                self._resize(len(self.slots) + step, now, why)
        # SIGCHLD only wakes the loop; reaping happens every pass.

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Supervise until stopped. Returns the exit code: 0, or 2 after a boot error."""
        self._install_signals()
        now = time.monotonic()
        try:
            # A boot error (schema missing, bad DSN) leaves as one line before anything is logged.
            self._boot(now)
        except BaseException:
            self._restore_signals()
            raise
        self._resize_pools(now, "start")
        log.event(
            "supervisor_started",
            pid=self.pid,
            processes=self.config.children,
            pools={p.name: p.processes for p in self.config.pools} or None,
            graceful_timeout=self.config.graceful_timeout,
        )
        try:
            while not self._finished():
                self._pass()
        finally:
            for child in list(self.children.values()):  # only when leaving on an exception
                self._kill(child, signal.SIGKILL)
                os.waitpid(child.pid, 0)
                self.children.pop(child.pid)
                self.hostdb.child_gone(child.worker_id, f"supervisor of {child.worker_id} failed")
            self.hostdb.flush(float("inf"))
            self.hostdb.close()
            self.relay.close()
            self._restore_signals()
        log.event("supervisor_stopped", pid=self.pid, exit_code=self.exit_code)
        return self.exit_code

    def _finished(self) -> bool:
        return self.stopping is not None and not self.children

    def _pass(self) -> None:
        self._wait(self._timeout(time.monotonic()))
        now = self._passed_at = time.monotonic()
        while True:
            try:
                signum = self._signals.get_nowait()
            except queue.Empty:
                break
            self._dispatch(signum, now)
        for child in self.children.values():
            child.look(now)
        self._reap(now)
        self._check_cancels(now)
        self._watchdog(now)
        self._write_rows(now)
        self.hostdb.flush(now)
        if self.stopping is None:
            self._boot(now)
            if self._booted and self.relay.ensure(now):
                self._relay(wakeup.WAKE_ALL)
            self._roll(now)
            self._spawn_due(now)
        else:
            self._escalate(now)

    def _timeout(self, now: float) -> float:
        wake = now + TICK
        if self.stopping is None:
            due = [s.spawn_at for s in self.slots if s.child is None]
            if due:
                wake = min(wake, min(due))
        if any(c.booted and c.row_run != c.current_run() for c in self.children.values()):
            wake = min(wake, self._rows_at + ROWS_CHANGE_GAP)  # a changed run to write
        return max(0.0, wake - now)

    def _relay(self, data: bytes) -> None:
        """Pass wake-up lines to every child's wake pipe."""
        for child in self.children.values():
            if child.wake_fd >= 0:
                wakeup.send(child.wake_fd, data)

    def _wait(self, timeout: float) -> None:
        """Sleep in select on the signal wake-up pipe, every child's liveness pipe and the wake-up
        relay's connection (its NOTIFYs passed on to every child at once). Beats wait in their
        pipes until PASS_GAP after the last pass: a busy host's children beat once per run, and a
        pass per beat cost the parent more than the beats (signals and the relay are at once)."""
        relay = self.relay.fileno()
        urgent = [self._wake_r] if relay is None else [self._wake_r, relay]
        start = time.monotonic()
        rest = min(self._passed_at + PASS_GAP - start, timeout)
        if rest > 0:
            if self._select(urgent, rest, relay):
                return
            timeout = max(0.0, timeout - (time.monotonic() - start))
        self._select([*urgent, *(c.fd for c in self.children.values())], timeout, relay)

    def _select(self, fds: list[int], timeout: float, relay: int | None) -> bool:
        """Wait for `fds` at most `timeout` seconds and handle what is ready; True if any was."""
        try:
            ready, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:  # pragma: no cover - PEP 475 retries select itself
            return False
        for fd in ready:
            if fd == relay:
                self._relay(self.relay.read(time.monotonic()))
                continue
            if fd == self._wake_r:
                try:
                    while os.read(fd, 512):
                        pass
                except (BlockingIOError, OSError):
                    pass
                continue
            for child in self.children.values():
                if child.fd == fd:
                    self._read(child, time.monotonic())
                    break
        return bool(ready)

    def _read(self, child: Forked, now: float) -> None:
        while True:
            try:
                data = os.read(child.fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                return
            if not data:
                return
            beat, error = latest(child.buffer.feed(data))
            if error is not None:
                child.error = error
            if beat is not None:
                child.heard(beat)
                child.last_beat = now
                if not child.booted:
                    child.booted = True
                    log.event("child_booted", pid=child.pid, worker=child.worker_id)

    # -- boot ---------------------------------------------------------------------------------

    def _boot(self, now: float) -> None:
        """Check the schema once before the first fork. A missing schema or a bad DSN raises (exit
        2); an unreachable database is retried with backoff, forever, reacting to signals."""
        if self._booted or now < self._boot_retry_at:
            return
        try:
            self.hostdb.check_schema()
        except (DatabaseUnavailable, psycopg.Error) as exc:
            if isinstance(exc, psycopg.Error) and not is_transient(exc):
                raise
            self._boot_failures += 1
            delay = policy.restart_delay(
                self._boot_failures,
                base=max(self.config.restart_backoff, 0.5),
                cap=self.config.restart_backoff_max,
                rand=self.rand.random(),
            )
            self._boot_retry_at = now + delay
            log.event(
                "db_unavailable",
                level=30,
                error=log.first_line(exc),
                retry_in=round(delay, 2),
            )
            return
        self._booted = True
        self.relay = Relay(self.config, behind_pooler=self.hostdb.behind_pooler)

    # -- children -----------------------------------------------------------------------------

    def _spawn_due(self, now: float) -> None:
        if not self._booted:
            return
        for slot in self.slots:
            if slot.child is None and now >= slot.spawn_at:
                self._spawn(slot, time.monotonic())

    def _spawn(self, slot: Slot, now: float) -> None:
        # Never hold a connection across fork(): the child would share the socket.
        self.hostdb.close()
        self.relay.close()
        suffix = uuid.uuid4().hex[:8]
        read_fd, write_fd = os.pipe()
        wake_r, wake_w = os.pipe() if self.relay.enabled else (-1, -1)
        board = Board()
        sys.stdout.flush()
        sys.stderr.flush()
        # Block signals around fork so that the child never runs the parent's handlers; it
        # installs its own and unblocks.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                inherited = [self._wake_r, self._wake_w, wake_w]
                for c in self.children.values():
                    inherited += [c.fd, c.wake_fd]
                child_main(
                    self.app,
                    self.config,
                    worker_id=f"{self.host}-{os.getpid()}-{suffix}",
                    beat_fd=write_fd,
                    parent_pid=self.pid,
                    inherited_fds=[fd for fd in inherited if fd >= 0],
                    pool=slot.pool,
                    wake_fd=None if wake_r < 0 else wake_r,
                    board=board,
                )
        finally:
            if os.getpid() == self.pid:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        if wake_r >= 0:
            os.close(wake_r)
            os.set_blocking(wake_w, False)
        child = Forked(
            pid=pid,
            worker_id=f"{self.host}-{pid}-{suffix}",
            fd=read_fd,
            started=now,
            generation=self.generation,
            slot=slot,
            last_beat=now,
            pool=presence.pool_of(self.config, slot.pool),
            wake_fd=wake_w,
            board=board,
        )
        slot.child = child
        self.children[pid] = child
        log.event(
            "child_spawned", pid=pid, worker=child.worker_id, failures=slot.failures, pool=slot.pool
        )

    def _reap(self, now: float) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:
                continue  # not ours (e.g. an orphan reparented to us as PID 1)
            self._exited(child, policy.exit_meaning(os.waitstatus_to_exitcode(status)), now)

    def _exited(self, child: Forked, meaning: ExitMeaning, now: float) -> None:
        self._read(child, now)  # a boot error may still be in the pipe
        child.look(now)  # its last state: what it ran when it died
        if child.board is not None:
            child.board.close()
            child.board = None
        os.close(child.fd)
        if child.wake_fd >= 0:
            os.close(child.wake_fd)
            child.wake_fd = -1
        uptime = now - child.started
        fields: dict[str, Any] = {
            "pid": child.pid,
            "worker": child.worker_id,
            "status": meaning.describe(),
            "uptime": round(uptime, 3),
            "jobs": child.beat.jobs if child.beat else 0,
        }
        if meaning.hint:
            fields["hint"] = meaning.hint
        if child.error:
            fields["error"] = child.error
        expected = self.stopping is not None or child.slot is None or child.killed
        log.event("child_exited", level=meaning.level if not expected else 20, **fields)
        # Fast release: whatever it held is claimable on the next poll anywhere, instead of
        # after the lease. Owner-scoped: a run another worker reclaimed already is not touched.
        release = None if meaning.clean else f"worker {child.worker_id} {meaning.describe()}"
        self.hostdb.child_gone(child.worker_id, release, child.kill_run, clean=meaning.clean)
        slot = child.slot
        if slot is None or slot not in self.slots:
            return
        slot.child = None
        if meaning.halts and self.stopping is None:
            self.halt_message = child.error or "a worker could not boot"
            self.exit_code = 2
            log.event("boot_failed", level=40, error=self.halt_message)
            self.stop(graceful=True, now=now, why="boot error")
            return
        slot.failures = policy.next_failures(
            slot.failures, meaning, uptime, self.config.restart_reset_after
        )
        delay = policy.restart_delay(
            slot.failures,
            base=self.config.restart_backoff,
            cap=self.config.restart_backoff_max,
            rand=self.rand.random(),
        )
        slot.spawn_at = now + delay
        if meaning.clean and self.stopping is None:
            log.event("child_recycled", pid=child.pid, worker=child.worker_id)
        elif delay > 0:
            log.event("restart_delayed", delay=round(delay, 3), failures=slot.failures)

    def _kill_all(self, signum: int) -> None:
        for child in self.children.values():
            self._kill(child, signum)

    def _kill(self, child: Forked, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)

    def _retire(self, child: Forked, why: str) -> None:
        """Stop a child gracefully without replacing it (its slot is gone or reassigned)."""
        child.slot = None
        self._kill(child, signal.SIGTERM)
        log.event("child_retiring", pid=child.pid, worker=child.worker_id, why=why)

    # -- watchdog and rows --------------------------------------------------------------------

    def _watchdog(self, now: float) -> None:
        """Kill (SIGKILL, at once) a child that holds a lease it could not confirm renewed in
        time, that went unresponsive, or whose run had to stop and whose handler ignored the
        interruption for abort_grace. Never a softer signal first: a child that gave its run back
        on its way out would have the attempt uncharged, and a run that hangs its process every
        time would then be retried for ever. The reaped child's run is recorded as crashed (its
        attempt charged), or with the outcome it was killed for (cancelled, timed out)."""
        cfg = self.config
        for child in list(self.children.values()):
            if child.watchdog_at is not None:
                continue
            liveness = child.liveness()
            verdict = policy.watchdog(
                now,
                liveness,
                enabled=cfg.watchdog,
                timing=None if liveness.lease is None else lease_timing(cfg, liveness.lease),
                hang_timeout=cfg.hang_timeout,
                abort_grace=cfg.abort_grace,
            )
            if verdict is None:
                continue
            child.watchdog_at = now
            child.killed = True
            fields: dict[str, Any] = {}
            if verdict is Verdict.ABORT:
                stop = policy.must_stop(liveness, now)
                reason = stop[0] if stop else "shutdown"
                child.kill_run = child.killed_for(reason)
                fields = {"why": reason, "since": round(now - stop[1], 3) if stop else None}
            else:
                fields = {
                    "silent_for": round(now - child.last_beat, 3),
                    "unrenewed_for": (
                        round(now - liveness.renewed, 3)
                        if verdict is Verdict.LEASE and liveness.renewed is not None
                        else None
                    ),
                }
            self._kill(child, signal.SIGKILL)
            log.event(
                "child_killed_by_watchdog",
                level=40,
                pid=child.pid,
                worker=child.worker_id,
                reason=str(verdict),
                run_id=liveness.run_id,
                **fields,
            )

    def _check_cancels(self, now: float) -> None:
        """Every control interval, ask the database whether a run a child holds was cancelled:
        the child's keeper sees it too, but a child stuck in a C call holding the GIL cannot,
        and must then be killed after abort_grace."""
        if now - self._cancels_at < lease_timing(self.config).control:
            return
        self._cancels_at = now
        holding = {
            ref.id: child
            for child in self.children.values()
            if not child.killed and (ref := child.run_ref()) is not None
        }
        refs = [ref for c in holding.values() if (ref := c.run_ref()) is not None]
        cancelled = self.hostdb.cancel_requested(refs, now)
        for run_id in cancelled or ():
            child = holding[run_id]
            if child.cancel_seen is None or child.cancel_seen[0] != run_id:
                child.cancel_seen = (run_id, now)

    def _write_rows(self, now: float) -> None:
        """One workers row per child, refreshed every heartbeat_interval, but only for children
        heard from since the last write: a silent child's heartbeat_at goes stale, truthfully."""
        interval = self.config.heartbeat_interval
        # Also when a child's current run changed (a claim, a finish), so the workers table shows
        # what each child runs, but at most every ROWS_CHANGE_GAP: not a transaction per run.
        changes = now - self._rows_at >= ROWS_CHANGE_GAP
        due = [
            c
            for c in self.children.values()
            if c.booted
            and (
                c.row_at is None
                or (now - c.row_at >= interval and c.last_beat > c.row_at)
                or (changes and c.current_run() != c.row_run)
            )
        ]
        if due:
            # The others heard from since their last row ride along: one transaction per
            # heartbeat for the host rather than one per child, each at its own phase (what a
            # fleet of idle children costs the database, bench/idle.py).
            due += [
                c
                for c in self.children.values()
                if c.booted and c not in due and c.row_at is not None and c.last_beat > c.row_at
            ]
        if not due:
            return
        self._rows_at = now  # tried: a failed write is tried again in ROWS_CHANGE_GAP, not at once
        rows = [Row(c.worker_id, c.pid, c.current_run(), c.pool) for c in due]
        if self.hostdb.heartbeat(rows, now):
            for c in due:
                c.row_at = now
                c.row_run = c.current_run()

    # -- stop, resize, reload -----------------------------------------------------------------

    def stop(self, *, graceful: bool, now: float, why: str) -> None:
        if self.stopping == "fast" or (self.stopping == "graceful" and graceful):
            return
        self.stopping = "graceful" if graceful else "fast"
        timeout = self.config.graceful_timeout + STOP_SLACK if graceful else FAST_STOP_TIMEOUT
        self._stop_deadline = now + timeout
        log.event(
            "supervisor_stopping",
            mode=self.stopping,
            why=why,
            children=len(self.children),
            deadline_s=round(timeout, 3),
        )
        self._kill_all(signal.SIGTERM if graceful else signal.SIGQUIT)

    def _escalate(self, now: float) -> None:
        if now < self._stop_deadline:
            return
        left = [c for c in self.children.values() if not c.killed]
        for child in left:
            child.killed = True
            child.kill_run = child.killed_for("shutdown")  # released, the attempt not charged
            self._kill(child, signal.SIGKILL)
            log.event("child_killed_at_deadline", level=30, pid=child.pid, worker=child.worker_id)

    def _resize_pools(self, now: float, why: str) -> None:
        """As many slots per pool as the config says (config `pools`; without pools, `processes`
        slots of no pool); a pool no longer configured loses all of its."""
        want: dict[str | None, int] = (
            {p.name: p.processes for p in self.config.pools}
            if self.config.pools
            else {None: self.config.processes}
        )
        for pool in [p for p in dict.fromkeys(s.pool for s in self.slots) if p not in want]:
            self._resize(0, now, why, pool)
        for pool, n in want.items():
            self._resize(n, now, why, pool)

    def _resize(self, n: int, now: float, why: str, pool: str | None = None) -> None:
        """`n` slots for `pool` (at least one without pools)."""
        n = max(1, n) if pool is None else max(0, n)
        mine = [s for s in self.slots if s.pool == pool]
        before = len(mine)
        while len(mine) < n:
            added = Slot(spawn_at=now, pool=pool)
            self.slots.append(added)
            mine.append(added)
        while len(mine) > n:
            empty = [s for s in mine if s.child is None]
            if empty:  # a slot waiting out a backoff goes first
                self.slots.remove(empty[-1])
                mine.remove(empty[-1])
                continue
            children = [s.child for s in mine if s.child is not None]
            pid = policy.pick_to_retire([Candidate(c.pid, c.started, c.busy) for c in children])
            child = next(c for c in children if c.pid == pid)
            slot = child.slot
            assert slot is not None
            self._retire(child, why)
            self.slots.remove(slot)
            mine.remove(slot)
        if before and before != n:
            log.event("processes_changed", before=before, after=n, why=why, pool=pool)

    def _reload(self, now: float) -> None:
        if self.reload is None:
            return
        try:
            config = self.reload()
            if config.dsn != self.config.dsn:
                # The new database must take the children that boot with it (reachable, the
                # credentials accepted, the schema in place), or the reload would replace
                # working children with ones that cannot boot, and halt the host.
                HostDB(config).check_schema()
        except Exception as exc:  # a bad file or database keeps the running config
            log.event("reload_failed", level=40, error=log.first_line(exc))
            return
        self.config = config
        self.app = self.app.with_config(config)
        self.hostdb.config = config
        if config.listen_dsn != self.relay.config.listen_dsn:
            self.relay.close()
            self.relay = Relay(config, behind_pooler=self.hostdb.behind_pooler)
        self.generation += 1
        log.event("config_reloaded", generation=self.generation, processes=config.children)
        self._resize_pools(now, "SIGHUP")

    def _roll(self, now: float) -> None:
        """After a reload, replace old-generation children one at a time: retire one only when
        every new-generation child has booted, so a broken new config never empties the host."""
        old = [
            s.child
            for s in self.slots
            if s.child is not None and s.child.generation < self.generation
        ]
        if not old:
            return
        if any(
            s.child is None or (s.child.generation == self.generation and not s.child.booted)
            for s in self.slots
        ):
            return
        cands = [Candidate(c.pid, c.started, c.busy) for c in old]
        pid = policy.pick_to_retire(cands)
        child = next(c for c in old if c.pid == pid)
        slot = child.slot
        assert slot is not None
        self._retire(child, "SIGHUP")
        slot.child = None
        slot.failures = 0
        slot.spawn_at = now
