"""What a forked child does: arrange to die with its parent, reset the parent's signal handling,
open its own connections, run one `Worker` until told to stop, and report liveness on its pipe.

Runs only in the child, after `fork()`; it never returns (it ends in `os._exit`), so nothing the
parent set up (atexit hooks, inherited objects' finalizers) runs twice. It never touches a
database connection made by the parent: the parent holds none at fork time.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

import psycopg

from .. import log
from ..db import DatabaseUnavailable
from ..errors import ConfigError, SchemaMissing, is_transient
from ..workers.context import describe_error
from ..workers.worker import Application, Worker
from .liveness import CHANGE_GAP, MIN_BEAT_GAP, Board, beat_line, encode_error, write_nowait
from .policy import ChildExit

if TYPE_CHECKING:
    from ..config import Config
    from ..workers.context import Context
    from ..workers.keeper import Held

PR_SET_PDEATHSIG = 1
# After a fast stop (QUIT, or the parent died) the child gets this long to give its run back
# before SIGALRM's default action ends it: with no parent left, nobody else would kill it.
FAST_EXIT_AFTER = 3.0
# Signals the parent handles for the whole group: a terminal's Ctrl-C or hang-up reaches every
# process in the group, and only the parent decides what they mean.
_IGNORED = (signal.SIGINT, signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1)


def set_parent_death_signal(signum: int) -> bool:
    """Linux: have the kernel send `signum` when the parent dies. False where unsupported; the
    pipe reaching EOF (a failed beat) and a getppid() check cover the rest."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


class BeatSender:
    """The child's end of the liveness pipe, called from `Worker.beat` (after each poll, at each
    claim and each ctx.check()) and from the lease keeper's thread after each of its ticks, so
    the parent hears about the run from its claim on whether or not the handler cooperates. Also
    where the child notices its parent is gone and recycles itself. Thread-safe.

    Every change is written at once to the child's board (liveness.Board, memory shared with the
    parent: a store, no system call), which the parent reads at each of its passes: the handler
    may next hold the GIL in a C call for ever, and the parent must know which run to kill it for.
    On the pipe, a run that must stop goes out at once; any other change (a new run, a finish,
    jobs done, a renewal) goes out at once unless a beat went out less than `gap` ago, and then
    waits for the end of that gap, sent by the next call after it or by a flusher thread at its
    end, whichever is first. The gap is MIN_BEAT_GAP with a board (the pipe only wakes the parent
    to read it; a write per run and the parent's pass for it cost a one-at-a-time host a tenth
    of its throughput: bench/README.md, issue 30) and CHANGE_GAP without one, when a new run goes
    out on the pipe at once too. Either way the parent hears of every change within the gap: far
    inside anything its watchdog acts on (seconds)."""

    def __init__(self, fd: int, parent_pid: int, max_jobs: int, board: Board | None = None) -> None:
        self.fd = fd
        self.board = board
        self._gap = CHANGE_GAP if board is None else MIN_BEAT_GAP
        self._posted: tuple[object, ...] = ()  # the state last written to the board
        self.parent_pid = parent_pid
        self.max_jobs = max_jobs
        self._last: tuple[object, ...] = ()
        self._sent_at = float("-inf")
        self.orphaned = False
        self._lock = threading.Lock()
        self._due = threading.Condition(self._lock)  # a change waits for the flusher
        self._pending: Worker | None = None
        self._flusher: threading.Thread | None = None
        # Whether the flusher waits without a deadline: only then does a pending change notify
        # it. Otherwise it is starting, or waits for the gap's end and wakes by itself, and looks
        # at what is pending then. A notify per change cost a thread switch and GIL hand-offs per
        # run (four or five futex calls a job), more than the beat.
        self._flusher_idle = False

    def __call__(self, worker: Worker, ctx: Context | None) -> None:
        with self._lock:
            self._beat(worker)

    def _beat(self, worker: Worker) -> None:
        if self.orphaned:
            return
        if os.getppid() != self.parent_pid:
            self._orphan(worker, "parent changed")
            return
        jobs = worker.jobs_done
        if self.max_jobs and jobs >= self.max_jobs and worker.running and not worker.stopping:
            # Stop claiming without a deadline: the job in hand (if any) finishes normally and
            # no stage claims again, so a child recycles after exactly max_jobs jobs.
            worker.drain()
            log.event("child_recycling", worker=worker.id, jobs=jobs)
        now = time.monotonic()
        # With async handlers a child runs several: the beat names the one whose deadline comes
        # first (Keeper.most_urgent), which is the one the parent's watchdog must watch.
        held, count = worker.keeper.most_urgent()
        runs = count if count > 1 else None
        if held is None:
            state: tuple[object, ...] = (None, None, None, jobs, runs)
        else:
            state = (held.claim.id, held.renewed, held.signal.reason, jobs, runs)
        since = now - self._sent_at
        last = self._last or (None, None, None, None, None)
        board, posted = self.board, False
        if board is not None and state != self._posted:
            self._post(board, now, held, jobs, runs)
            self._posted, posted = state, True
        if state == self._last:
            if since < MIN_BEAT_GAP:
                return
        elif (
            since < self._gap
            and (board is not None or state[0] is None or state[0] == last[0])
            and state[2] == last[2]
        ):
            if self._pending is None:  # else the flusher is already waiting for the gap's end
                self._pending = worker
                self._flush_later()
            return
        if board is not None and not posted:
            self._post(board, now, held, jobs, runs)  # the beat's time too: as fresh as the pipe
        if held is None:
            line = beat_line(now, None, None, None, jobs)
        else:
            claim, reason = held.claim, held.signal.reason
            line = beat_line(
                now,
                claim.id,
                held.renewed,
                claim.lease_seconds,
                jobs,
                owner=claim.owner.hex,  # its 32 digits, as uuid.UUID reads them: cheaper than str
                attempt=claim.attempts,
                timeout_at=held.deadline,
                abort=reason,
                abort_at=None if reason is None else (held.tripped_at or now),
                runs=runs,
            )
        self._pending = None
        try:
            if write_nowait(self.fd, line):
                self._last, self._sent_at = state, now
        except OSError:  # EPIPE: the read end is closed, so the parent is gone
            self._orphan(worker, "liveness pipe closed")

    @staticmethod
    def _post(board: Board, now: float, held: Held | None, jobs: int, runs: int | None) -> None:
        if held is None:
            board.write(now, None, None, None, jobs)
            return
        claim, reason = held.claim, held.signal.reason
        board.write(
            now,
            claim.id,
            held.renewed,
            claim.lease_seconds,
            jobs,
            owner=claim.owner.bytes,
            attempt=claim.attempts,
            timeout_at=held.deadline,
            abort=reason,
            abort_at=None if reason is None else (held.tripped_at or now),
            runs=runs,
        )

    def _flush_later(self) -> None:
        """Have the flusher send the pending change at the end of the gap (the lock is held):
        woken once per gap, not per change (a thread switch per run would cost more than the
        beat it saves). A flusher waiting for a deadline already wakes by itself, at the end of
        the gap or earlier, and then waits again for what is left of it."""
        if self._flusher is None:
            self._flusher = threading.Thread(
                target=self._flush_loop, name="leasework-beat", daemon=True
            )
            self._flusher.start()
        if self._flusher_idle:
            self._flusher_idle = False  # notified: it looks at what is pending once it runs
            self._due.notify()

    def _flush_loop(self) -> None:
        with self._lock:
            while not self.orphaned:
                worker = self._pending
                if worker is None:
                    self._flusher_idle = True
                    self._due.wait()
                    self._flusher_idle = False
                    continue
                wait = self._sent_at + self._gap - time.monotonic()
                if wait > 0:
                    self._due.wait(wait)
                    continue
                self._pending = None  # sent now, or no longer a change
                self._beat(worker)

    def _orphan(self, worker: Worker, why: str) -> None:
        self.orphaned = True
        log.event("parent_gone", level=30, worker=worker.id, why=why)
        _fast_stop(worker)

    def error(self, message: str) -> None:
        with contextlib.suppress(OSError):
            os.write(self.fd, encode_error(message))


def _fast_stop(worker: Worker) -> None:
    worker.stop(graceful=False)
    # setitimer is async-signal-safe enough for CPython's handler context: it only records a
    # deadline in the kernel. SIGALRM keeps its default action (terminate).
    signal.setitimer(signal.ITIMER_REAL, FAST_EXIT_AFTER)


def _install_signals(worker: Worker) -> None:
    """TERM: graceful stop. QUIT (also the parent-death signal): fast stop. The handlers only
    record the request on the worker; the loop acts on it."""

    def on_term(signum: int, frame: FrameType | None) -> None:
        worker.stop(graceful=True)

    def on_quit(signum: int, frame: FrameType | None) -> None:
        _fast_stop(worker)
        worker.interrupt_now()  # Aborted in the handler, if one is running

    signal.set_wakeup_fd(-1)  # the parent's wake-up pipe is not ours
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGQUIT, on_quit)


def _close_fds(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def child_main(
    app: Application,
    config: Config,
    *,
    worker_id: str,
    beat_fd: int,
    parent_pid: int,
    inherited_fds: Iterable[int],
    pool: str | None = None,
    wake_fd: int | None = None,
    board: Board | None = None,
) -> NoReturn:
    """Entry point right after fork. Exits with a `ChildExit` code; never returns. `pool`: the
    pool (config `pools`) whose kinds this child claims; None: every kind. `wake_fd`: the read
    end of its wake pipe, where the parent relays NOTIFYs (wakeup.py). `board`: where its beat
    stands in memory shared with the parent (liveness.Board)."""
    code = int(ChildExit.CRASH)
    try:
        code = int(
            _run(app, config, worker_id, beat_fd, parent_pid, inherited_fds, pool, wake_fd, board)
        )
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            log.event("child_crashed", level=40, worker=worker_id, error=describe_error(exc, 5))
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _run(
    app: Application,
    config: Config,
    worker_id: str,
    beat_fd: int,
    parent_pid: int,
    inherited_fds: Iterable[int],
    pool: str | None = None,
    wake_fd: int | None = None,
    board: Board | None = None,
) -> ChildExit:
    set_parent_death_signal(signal.SIGQUIT)
    _close_fds(inherited_fds)
    beacon = BeatSender(beat_fd, parent_pid, config.max_jobs_per_child, board)
    worker = Worker(
        app,
        config,
        worker_id=worker_id,
        on_beat=beacon,
        register=False,
        deadman=config.deadman,
        pool=pool,
    )
    if wake_fd is not None:
        os.set_blocking(wake_fd, False)
        worker.conns.wake.relay_fd = wake_fd  # behind a pooler, wake-ups come from the parent
    _install_signals(worker)
    # The parent blocked every signal around fork(); anything that arrived since is delivered
    # now, to the handlers above.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        return ChildExit.OK
    random.seed()  # never share the parent's random sequence (retry jitter)
    try:
        worker.open()
    except (SchemaMissing, ConfigError) as exc:
        beacon.error(str(exc))
        worker.close()
        return ChildExit.BOOT_ERROR
    except (DatabaseUnavailable, psycopg.Error, TimeoutError) as exc:
        if isinstance(exc, psycopg.Error) and not is_transient(exc):
            raise
        log.event("child_db_unavailable", level=30, worker=worker_id, error=describe_error(exc))
        worker.close()
        return ChildExit.DB_UNAVAILABLE
    except Exception as exc:
        if is_transient(exc):  # psycopg_pool.PoolTimeout
            log.event("child_db_unavailable", level=30, worker=worker_id, error=describe_error(exc))
            worker.close()
            return ChildExit.DB_UNAVAILABLE
        raise
    if worker.stopping:  # told to stop while booting
        worker.close()
        return ChildExit.OK
    worker.beat(None)  # the first beat tells the parent this child has booted
    worker.run()
    return ChildExit.OK
