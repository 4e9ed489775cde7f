"""The exceptions leasework raises, and the one function that decides which database errors are
transient (worth retrying) rather than bugs or bad input."""

from __future__ import annotations

import contextlib
import math
import numbers
import reprlib
from typing import Any

import psycopg
from psycopg import errors as pgerrors


class LeaseworkError(Exception):
    """Base of every error leasework raises on purpose."""


class ConfigError(LeaseworkError):
    """Bad configuration, bad usage or bad input: exit code 2, nothing written."""


class NotFound(ConfigError):
    """An id or a kind that names nothing (no such run, no such kind): bad input like any other
    ConfigError; the dashboard answers it 404 rather than 409."""


class StateConflict(LeaseworkError):
    """An action a run's state does not allow, though the input is well formed: retrying a queued
    run, deleting a running one, retrying a run whose key has another active run, running now a
    run that is not queued. Exit code 2 in the CLI (as bad input), 409 in the dashboard; nothing
    changed."""


class UnknownKind(ConfigError):
    """A run kind no handler is registered for."""


class PayloadError(ConfigError):
    """A payload that is not JSON, or is over the size cap."""


class WrongConnection(ConfigError, TypeError):
    """A sync method given a psycopg AsyncConnection, an `_async` one given a sync Connection, or
    something that is no psycopg connection at all."""


class ResultError(LeaseworkError, ValueError):
    """A handler's result (or ctx.result) that cannot be stored as jsonb: the run fails, retried
    like any handler error."""


class SchemaMissing(LeaseworkError):
    """The database has no leasework schema (run `leasework migrate`) or an older one."""


class LeaseLost(LeaseworkError):
    """The run is no longer this worker's: raised by the fenced transaction before any write."""


class RunFailed(LeaseworkError):
    """Raised by `handle.wait()` / `app.wait()` for a run that ended without success: `status`
    is "failed" (this class), "cancelled" (RunCancelled) or "partial" (RunPartial); `error` is
    the run's error, `result` its result (a partial one, or what the handler stored)."""

    def __init__(self, run_id: int, status: str, error: str | None, result: Any = None) -> None:
        first = (error or "").strip().splitlines()[0] if error and error.strip() else None
        super().__init__(f"run {run_id} ended {status}" + (f": {first}" if first else ""))
        self.run_id = run_id
        self.status = status
        self.error = error
        self.result = result


class RunCancelled(RunFailed):
    """`wait()` of a run that ended `cancelled`."""


class RunPartial(RunFailed):
    """`wait()` of a run that ended `partial`: its partial result is `result`."""


class WaitTimeout(LeaseworkError, TimeoutError):
    """`wait(timeout=...)` ran out before the run ended. The run is left as it is; `status` is
    the last one read."""

    def __init__(self, run_id: int, status: str, timeout: float) -> None:
        super().__init__(f"run {run_id} is still {status} after waiting {timeout:g} s")
        self.run_id = run_id
        self.status = status
        self.timeout = timeout


class Aborted(LeaseworkError):
    """Raised by `ctx.check()` when the run's abort signal tripped.

    `reason` is one of "cancelled", "lost", "timeout", "shutdown".
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# The longest wait a handler may ask for: a Retry-After beyond this is a bug or a bad header,
# not a plan, and a run parked for longer holds its key (no other run for it) all that time.
MAX_RETRY_AFTER = 30 * 24 * 3600.0  # 30 days, in seconds


class Retry(Exception):
    """Raised by a handler to ask for another attempt, after `after` seconds if given.

    A provider's Retry-After given here wins over the backoff. `after` is None (use the
    backoff) or a number of seconds from 0 to MAX_RETRY_AFTER (30 days). Anything else (a bool,
    a string, nan, infinity, a negative or a larger number) raises ValueError where the Retry is
    made, so inside a handler it is an ordinary failure, retried like any other.
    """

    def __init__(self, after: float | None = None, message: str = "retry requested") -> None:
        super().__init__(message)
        self.after = _retry_after(after)


def _retry_after(after: object) -> float | None:
    if after is None:
        return None
    return _seconds("Retry", after, ", or None for the backoff")


def _seconds(what: str, after: object, otherwise: str) -> float:
    """`after` as seconds from 0 to MAX_RETRY_AFTER, or one ValueError naming what is valid."""
    seconds = math.nan  # not a number: refused below, as nan and infinity are
    if isinstance(after, numbers.Real) and not isinstance(after, bool):
        with contextlib.suppress(OverflowError):  # an int too large for a float
            seconds = float(after)
    if not 0 <= seconds <= MAX_RETRY_AFTER:
        raise ValueError(
            f"{what}(after={reprlib.repr(after)}): after must be a number of seconds from 0 to "
            f"{MAX_RETRY_AFTER:.0f} (30 days){otherwise}"
        )
    return seconds


class Snooze(Exception):
    """Raised by a handler to put its run back to sleep: queued again, due `after` seconds from
    now (database time), the attempt NOT charged (attempts stay as they were, so max_attempts is
    not used up) and no failure counted. `after` is a number of seconds from 0 to MAX_RETRY_AFTER
    (30 days); anything else raises ValueError where the Snooze is made, so inside a handler it
    is an ordinary failure, retried like any other. `reason`, if given, goes into the run's
    history. A run snoozes at most `max_snoozes` times (a setting, default 100); the snooze past
    that ends it `failed`."""

    def __init__(self, after: float, reason: str | None = None) -> None:
        seconds = _seconds("Snooze", after, "")
        super().__init__(reason if reason is not None else f"snoozed for {seconds:g} s")
        self.after = seconds
        self.reason = None if reason is None else str(reason)


class Fail(Exception):
    """Raised by a handler to end its run `failed` now, whatever attempts are left: no retry.
    `reason` is recorded as the run's error (and in its history). `result`, if not None, is kept
    as the run's result (else what the handler stored in ctx.result is kept). Raised `from` an
    exception (`raise Fail("record 42 was deleted") from exc`), that exception's type, message
    and traceback tail follow the reason in the error. A cancel requested meanwhile still wins
    (the run ends `cancelled`). Unlike `Partial(result, retryable=False)`, which reports work
    partly done and ends the run `partial`, Fail says the run failed and no attempt can help."""

    def __init__(self, reason: str = "failed", *, result: Any = None) -> None:
        super().__init__(reason)
        self.reason = str(reason)
        self.result = result


class Partial(Exception):
    """Raised by a handler that got part of the work done.

    retryable=True requeues the run keeping `result`; otherwise the run is sealed `partial`.
    """

    def __init__(
        self, result: Any, retryable: bool = False, message: str = "partial result"
    ) -> None:
        super().__init__(message)
        self.result = result
        self.retryable = retryable


_TRANSIENT_SQLSTATE_CLASSES = ("08", "53", "57", "40")  # connection, resources, operator, rollback


def is_transient(exc: BaseException) -> bool:
    """True for database errors that a retry can fix: lost connections, restarts, deadlocks,
    serialization failures, too many connections, a lock another session held past
    lock_timeout. False for bugs and bad input."""
    if isinstance(exc, psycopg.OperationalError | psycopg_pool_timeout()):
        return not isinstance(exc, pgerrors.InsufficientPrivilege)
    if isinstance(exc, psycopg.Error):
        state = exc.sqlstate or ""
        return state[:2] in _TRANSIENT_SQLSTATE_CLASSES
    return isinstance(exc, ConnectionError | TimeoutError)


def gave_up_on_lock(exc: BaseException) -> bool:
    """True when a statement gave up on a row or key another session holds (lock_timeout,
    NOWAIT): worth trying again later, not at once, since that session still holds it."""
    return isinstance(exc, pgerrors.LockNotAvailable)


def psycopg_pool_timeout() -> type[Exception]:
    from psycopg_pool import PoolTimeout

    return PoolTimeout
