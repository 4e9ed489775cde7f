"""The supervisor's decisions as pure functions: what a child's exit status means, how long to
wait before restarting it, whether the watchdog must kill it, which child to retire first.

Every function takes the time it needs as an argument (`now`, `uptime`) and does no I/O: no
syscalls, no clock reads, no database. The parent loop calls them and performs the effects.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum

from ..config import LeaseTiming


class ChildExit(IntEnum):
    """The exit codes a child uses to tell the parent why it stopped."""

    OK = 0  # stopped on request, recycled, or saw its parent go
    CRASH = 1  # an unexpected exception, or user code calling exit(1)
    BOOT_ERROR = 3  # no restart can fix it: schema missing, bad config
    DB_UNAVAILABLE = 4  # could not reach the database at start-up: retry with backoff


class ExitKind(StrEnum):
    OK = "ok"
    CRASHED = "crashed"
    KILLED = "killed"
    BOOT_ERROR = "boot_error"
    DB_UNAVAILABLE = "db_unavailable"


@dataclass(frozen=True)
class ExitMeaning:
    kind: ExitKind
    code: int | None  # the exit code, when the child exited
    signal: int | None  # the signal that killed it, when it was killed
    level: int  # log level of the `child_exited` event
    hint: str | None = None

    @property
    def clean(self) -> bool:
        """The child stopped on purpose: restart at once, no backoff, nothing to release."""
        return self.kind is ExitKind.OK

    @property
    def halts(self) -> bool:
        """No restart can fix it: the supervisor stops and exits 2."""
        return self.kind is ExitKind.BOOT_ERROR

    def describe(self) -> str:
        if self.signal is not None:
            return f"killed by {signal_name(self.signal)}"
        return f"exited with code {self.code}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_meaning(exitcode: int) -> ExitMeaning:
    """Decode `os.waitstatus_to_exitcode(status)`: >= 0 is an exit code, < 0 a signal."""
    if exitcode < 0:
        sig = -exitcode
        if sig == signal.SIGKILL:
            # Like gunicorn: SIGKILL from nobody we know of is most often the OOM killer.
            return ExitMeaning(
                ExitKind.KILLED, None, sig, logging.ERROR, "perhaps out of memory, or kill -9"
            )
        level = logging.INFO if sig in (signal.SIGTERM, signal.SIGQUIT) else logging.WARNING
        return ExitMeaning(ExitKind.KILLED, None, sig, level)
    if exitcode == ChildExit.OK:
        return ExitMeaning(ExitKind.OK, exitcode, None, logging.INFO)
    if exitcode == ChildExit.BOOT_ERROR:
        return ExitMeaning(ExitKind.BOOT_ERROR, exitcode, None, logging.ERROR)
    if exitcode == ChildExit.DB_UNAVAILABLE:
        return ExitMeaning(ExitKind.DB_UNAVAILABLE, exitcode, None, logging.WARNING)
    return ExitMeaning(ExitKind.CRASHED, exitcode, None, logging.ERROR)


def next_failures(previous: int, meaning: ExitMeaning, uptime: float, reset_after: float) -> int:
    """Consecutive failures of a slot after this exit. A clean exit clears the streak; a child
    that stayed up `reset_after` seconds before failing starts a new streak at 1."""
    if meaning.clean:
        return 0
    if uptime >= reset_after:
        return 1
    return previous + 1


def restart_delay(failures: int, *, base: float, cap: float, rand: float) -> float:
    """Seconds to wait before restarting a slot after `failures` consecutive failures.

    Exponential (base, 2·base, 4·base, … capped at `cap`) with "equal jitter": the delay is
    drawn from [d/2, d] by `rand` in [0, 1), so slots that crash together do not restart
    together, and a crash-looping job cannot spin the CPU."""
    if failures <= 0:
        return 0.0
    # Cap the exponent before computing: 2 ** 10_000 would overflow a float.
    ceiling = min(cap, base * 2.0 ** min(failures - 1, 64))
    return ceiling / 2 + ceiling / 2 * min(max(rand, 0.0), 1.0)


class Verdict(StrEnum):
    LEASE = "lease"  # holds a run and has not renewed it for longer than lease - margin
    HANG = "hang"  # silent for longer than hang_timeout
    ABORT = "abort"  # its run must stop (cancel, timeout, ...) and the handler ignored it


@dataclass(frozen=True)
class Liveness:
    """What the parent last heard from a child (monotonic times)."""

    last_beat: float
    run_id: int | None = None
    renewed: float | None = None  # last successful renewal of the current run's lease
    lease: float | None = None  # the current run's lease length in seconds
    timeout_at: float | None = None  # when the run's attempt times out
    abort: str | None = None  # why the run must stop, as the child or the parent knows it
    abort_at: float | None = None  # since when


def must_stop(child: Liveness, now: float) -> tuple[str, float] | None:
    """Why and since when the child's current run must stop, if it must: the reason the child
    reported (or the parent saw: a cancel request), or its attempt's timeout having passed."""
    if child.run_id is None:
        return None
    if child.abort is not None and child.abort_at is not None:
        if child.timeout_at is not None and child.timeout_at < child.abort_at:
            return "timeout", child.timeout_at
        return child.abort, child.abort_at
    if child.timeout_at is not None and now >= child.timeout_at:
        return "timeout", child.timeout_at
    return None


def outcome_after_kill(reason: str | None) -> str | None:
    """What the parent writes for the run of a child it killed because the run had to stop:
    `cancelled`, `timeout` (a failed attempt, retried while attempts remain), `released` (shut
    down: the attempt not charged); None when nothing may be written (the lease was lost) or
    the run is released as a crashed attempt (any other kill)."""
    return {"cancelled": "cancelled", "timeout": "timeout", "shutdown": "released"}.get(
        reason or ""
    )


def watchdog(
    now: float,
    child: Liveness,
    *,
    enabled: bool,
    timing: LeaseTiming | None,
    hang_timeout: float,
    abort_grace: float = float("inf"),
) -> Verdict | None:
    """Whether a child must be killed. `timing`: the timings of its run's lease (lease_timing:
    the margin is scaled to a run's own lease, a task with a 10 s lease gets a proportionally
    smaller margin than the 120 s default), None when it holds none. A worker that
    keeps running after losing its lease is worse than one that crashes. A run that must stop
    (cancelled, timed out, lost, shut down) gets `abort_grace` to return, whether or not the
    watchdog is enabled: a cancel must end a handler that ignores it."""
    stop = must_stop(child, now)
    if stop is not None and now - stop[1] >= abort_grace:
        return Verdict.ABORT
    if not enabled:
        return None
    if (
        child.run_id is not None
        and child.renewed is not None
        and timing is not None
        and now - child.renewed > timing.unrenewed_max
    ):
        return Verdict.LEASE
    if hang_timeout > 0 and now - child.last_beat > hang_timeout:
        return Verdict.HANG
    return None


@dataclass(frozen=True)
class Candidate:
    """A child that could be retired (TTOU, a smaller `processes` after HUP, a reload)."""

    pid: int
    started: float
    busy: bool


def pick_to_retire(children: Sequence[Candidate]) -> int | None:
    """The child to stop first: an idle one before a busy one, then the youngest (its warm-up
    is the cheapest to lose). None if there is no candidate."""
    if not children:
        return None
    return min(children, key=lambda c: (c.busy, -c.started, c.pid)).pid
