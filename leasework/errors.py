"""The exceptions leasework raises, and the one function that decides which database errors are
transient (worth retrying) rather than bugs or bad input."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import errors as pgerrors


class LeaseworkError(Exception):
    """Base of every error leasework raises on purpose."""


class ConfigError(LeaseworkError):
    """Bad configuration, bad usage or bad input: exit code 2, nothing written."""


class UnknownKind(ConfigError):
    """A run kind no handler is registered for."""


class PayloadError(ConfigError):
    """A payload that is not JSON, or is over the size cap."""


class ResultError(LeaseworkError, ValueError):
    """A handler's result (or ctx.result) that cannot be stored as jsonb: the run fails, retried
    like any handler error."""


class SchemaMissing(LeaseworkError):
    """The database has no leasework schema (run `leasework migrate`) or an older one."""


class LeaseLost(LeaseworkError):
    """The run is no longer this worker's: raised by the fenced transaction before any write."""


class Aborted(LeaseworkError):
    """Raised by `ctx.check()` when the run's abort signal tripped.

    `reason` is one of "cancelled", "lost", "timeout", "shutdown".
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Retry(Exception):
    """Raised by a handler to ask for another attempt, after `after` seconds if given.

    A provider's Retry-After given here wins over the backoff.
    """

    def __init__(self, after: float | None = None, message: str = "retry requested") -> None:
        super().__init__(message)
        if after is not None and after < 0:
            raise ValueError("Retry(after=...) must be >= 0 seconds")
        self.after = after


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
    serialization failures, too many connections. False for bugs and bad input."""
    if isinstance(exc, psycopg.OperationalError | psycopg_pool_timeout()):
        return not isinstance(exc, pgerrors.InsufficientPrivilege)
    if isinstance(exc, psycopg.Error):
        state = exc.sqlstate or ""
        return state[:2] in _TRANSIENT_SQLSTATE_CLASSES
    return isinstance(exc, ConnectionError | TimeoutError)


def psycopg_pool_timeout() -> type[Exception]:
    from psycopg_pool import PoolTimeout

    return PoolTimeout
