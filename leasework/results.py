"""Waiting for a run's end (`handle.wait()`, `app.wait()`): the run's result, or its failure raised.
On a direct connection it LISTENs on `leasework_ended` after marking the run so that its end
NOTIFYs (leasework.run_outcome; only marked runs notify); through a pooler, where a LISTEN cannot
be kept, it polls at a growing interval. Writes nothing but that mark; one core for the sync and
the awaited path (`_waiting`), the connection's I/O at the edge."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Generator
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import orjson
import psycopg
from psycopg.pq import TransactionStatus

from .errors import (
    ConfigError,
    NotFound,
    RunCancelled,
    RunFailed,
    RunPartial,
    WaitTimeout,
    WrongConnection,
)
from .queries import load

Q = load("leasework", "results.sql")
Conn = psycopg.Connection[Any]
AConn = psycopg.AsyncConnection[Any]

CHANNEL = "leasework_ended"  # leasework.run_ended (schema.sql) NOTIFYs it with the run's id
TERMINAL = frozenset({"succeeded", "partial", "failed", "cancelled"})

# Through a pooler: the first read again after 50 ms, each pause half as long again, at most 1 s.
POLL_FIRST = 0.05
POLL_GROWTH = 1.5
POLL_MAX = 1.0
# On a direct connection the run is read again at least this often whatever NOTIFY says: a
# notification handler of the caller's own on the connection takes NOTIFYs before `notifies()`.
RECHECK = 5.0

__all__ = ["CHANNEL", "wait", "wait_async"]


@dataclass(frozen=True)
class _Read:
    """Read the run's status, result and error (marking it to NOTIFY its end if `watch`)."""

    watch: bool


@dataclass(frozen=True)
class _Notified:
    """Wait up to `seconds` for NOTIFYs: answered with the payloads received."""

    seconds: float


@dataclass(frozen=True)
class _Sleep:
    seconds: float


_Action = _Read | _Notified | _Sleep
# status, result as JSON text, error, and whether the run is marked to NOTIFY its end
Row = tuple[str, str | None, str | None, bool] | None


def check_timeout(timeout: object) -> float | None:
    """None (wait as long as it takes) or a number of seconds >= 0, else one ConfigError."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
        math.isfinite(timeout) and timeout >= 0
    ):
        raise ConfigError(
            f"wait(timeout={timeout!r}): timeout must be a number of seconds >= 0, or None to "
            "wait until the run ends"
        )
    return float(timeout)


def check_run_id(run_id: object) -> int:
    if isinstance(run_id, bool) or not isinstance(run_id, int) or not 1 <= run_id < 2**63:
        raise ConfigError(f"run id must be a positive 64-bit integer, got {run_id!r}")
    return run_id


def outcome(run_id: int, status: str, result: str | None, error: str | None) -> Any:
    """The result of a run that succeeded; the failure of one that did not, raised."""
    value = None if result is None else orjson.loads(result)
    if status == "succeeded":
        return value
    kind = {"cancelled": RunCancelled, "partial": RunPartial}.get(status, RunFailed)
    raise kind(run_id, status, error, value)


def _waiting(
    run_id: int, timeout: float | None, pooled: bool, clock: Callable[[], float]
) -> Generator[_Action, Any, Any]:
    """The wait as the actions it asks of its driver, each answered: a `_Read` with the run's
    row (None: no such run), `_Notified` with the payloads received, `_Sleep` with None. The
    driver LISTENs before the first read on a direct connection (`pooled` False), so a run that
    ends after that read is NOTIFYed, and one that ended before it is seen by it."""
    deadline = None if timeout is None else clock() + timeout
    row: Row = yield _Read(watch=not pooled)
    delay = POLL_FIRST
    ours = str(run_id)
    while True:
        if row is None:
            raise NotFound(
                f"no run {run_id} (an enqueue that has not committed yet is not visible to "
                "another connection: wait after the commit)"
            )
        status, result, error, watched = row
        if status in TERMINAL:
            return outcome(run_id, status, result, error)
        left = None if deadline is None else deadline - clock()
        if left is not None and left <= 0:
            raise WaitTimeout(run_id, status, timeout or 0.0)
        if pooled or not watched:
            # Polled: through a pooler, or while another session holds the row (its mark is
            # asked for again at the next read).
            yield _Sleep(delay if left is None else min(delay, left))
            delay = min(delay * POLL_GROWTH, POLL_MAX)
            row = yield _Read(watch=not pooled)
            continue
        pause = RECHECK if left is None else min(RECHECK, left)
        until = clock() + pause
        while True:
            payloads: list[str] = yield _Notified(pause)
            pause = until - clock()
            if ours in payloads or not payloads or pause <= 0:
                break  # ours, or quiet for `pause`: read the run again
        row = yield _Read(watch=False)


def _row(found: Any) -> Row:
    if found is None or found[0] is None:
        return None
    return str(found[0]), found[1], found[2], bool(found[3])


def _idle(conn: Conn | AConn) -> None:
    """A wait needs a connection outside any transaction: a NOTIFY arrives only between
    transactions, and the run it waits for cannot start before the enqueue commits."""
    state = conn.info.transaction_status
    if state != TransactionStatus.IDLE:
        what = "closed or broken" if state == TransactionStatus.UNKNOWN else "inside a transaction"
        raise WrongConnection(
            f"wait(): the connection is {what}: commit the enqueue first (the run cannot start "
            "before it commits), then wait on an open connection outside any transaction"
        )


def wait(conn: Conn, run_id: int, timeout: float | None = None) -> Any:
    """Wait on `conn` (a psycopg Connection outside any transaction; used in autocommit for the
    wait, then given back as it was) until run `run_id` ends: its result if it succeeded, else
    RunFailed / RunCancelled / RunPartial. WaitTimeout after `timeout` seconds (None: no limit),
    the run left as it is; NotFound if there is no such run (or it is not committed yet)."""
    if not isinstance(conn, psycopg.Connection):
        raise WrongConnection(f"wait() needs a psycopg.Connection, got {type(conn).__name__}")
    run_id, timeout = check_run_id(run_id), check_timeout(timeout)
    _idle(conn)
    saved = conn.autocommit
    conn.autocommit = True
    try:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()
        pooled = conn.prepare_threshold is None or pid is None or pid[0] != conn.info.backend_pid
        if not pooled:
            conn.execute(f"LISTEN {CHANNEL}")
        try:
            steps = _waiting(run_id, timeout, pooled, time.monotonic)
            action = next(steps)
            while True:
                answer: Any = None
                if isinstance(action, _Read):
                    params = {"id": run_id, "watch": action.watch}
                    answer = _row(conn.execute(Q["run_outcome"], params).fetchone())
                elif isinstance(action, _Notified):
                    notes = conn.notifies(timeout=action.seconds, stop_after=1)
                    answer = [n.payload for n in notes if n.channel == CHANNEL]
                else:
                    time.sleep(action.seconds)
                try:
                    action = steps.send(answer)
                except StopIteration as done:
                    return done.value
        finally:
            if not pooled and not conn.closed:
                with suppress(psycopg.Error):
                    conn.execute(f"UNLISTEN {CHANNEL}")
    finally:
        if not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
            conn.autocommit = saved


async def wait_async(conn: AConn, run_id: int, timeout: float | None = None) -> Any:
    """`wait` on a psycopg AsyncConnection, awaited."""
    if not isinstance(conn, psycopg.AsyncConnection):
        raise WrongConnection(
            f"wait_async() needs a psycopg.AsyncConnection, got {type(conn).__name__}"
        )
    run_id, timeout = check_run_id(run_id), check_timeout(timeout)
    _idle(conn)
    saved = conn.autocommit
    await conn.set_autocommit(True)
    try:
        cur = await conn.execute("SELECT pg_backend_pid()")
        pid = await cur.fetchone()
        pooled = conn.prepare_threshold is None or pid is None or pid[0] != conn.info.backend_pid
        if not pooled:
            await conn.execute(f"LISTEN {CHANNEL}")
        try:
            steps = _waiting(run_id, timeout, pooled, time.monotonic)
            action = next(steps)
            while True:
                answer: Any = None
                if isinstance(action, _Read):
                    params = {"id": run_id, "watch": action.watch}
                    cur = await conn.execute(Q["run_outcome"], params)
                    answer = _row(await cur.fetchone())
                elif isinstance(action, _Notified):
                    notes = conn.notifies(timeout=action.seconds, stop_after=1)
                    answer = [n.payload async for n in notes if n.channel == CHANNEL]
                else:
                    await asyncio.sleep(action.seconds)
                try:
                    action = steps.send(answer)
                except StopIteration as done:
                    return done.value
        finally:
            if not pooled and not conn.closed:
                with suppress(psycopg.Error):
                    await conn.execute(f"UNLISTEN {CHANNEL}")
    finally:
        if not conn.closed and conn.info.transaction_status == TransactionStatus.IDLE:
            await conn.set_autocommit(saved)
