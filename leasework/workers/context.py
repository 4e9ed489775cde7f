"""The handler's view of its run: the abort signal, `check()`, progress checkpoints and the fenced
transaction for effects. Renewal and control go through the worker's reserved connection, so a
handler that exhausts the pool cannot starve its own lease."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import psycopg

from .. import log
from ..errors import Aborted, LeaseLost, is_transient
from . import lease
from .lease import Claim

if TYPE_CHECKING:
    from .worker import Worker

Conn = psycopg.Connection[Any]


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


class Context:
    """Passed to every handler as its first argument."""

    def __init__(
        self,
        claim: Claim,
        worker: Worker,
        *,
        renew_every: float,
        control_every: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.claim = claim
        self.signal = AbortSignal()
        self.result: Any = claim.result
        self._worker = worker
        self._clock = clock
        self._renew_every = renew_every
        self._control_every = control_every
        started = clock()
        self.started = started
        self.last_renewal = started
        self._last_control = started
        self._deadline = None if claim.timeout_seconds is None else started + claim.timeout_seconds
        self._processed = claim.processed_units
        self._total = claim.total_units
        self._tx_conn: Conn | None = None

    # -- what the handler reads -------------------------------------------------------------

    @property
    def run_id(self) -> int:
        return self.claim.id

    @property
    def kind(self) -> str:
        return self.claim.kind

    @property
    def payload(self) -> Any:
        return self.claim.payload

    @property
    def attempt(self) -> int:
        return self.claim.attempts

    @property
    def key(self) -> str | None:
        return self.claim.key

    @property
    def tenant(self) -> str | None:
        return self.claim.tenant

    @property
    def processed(self) -> int:
        """Units already done by earlier attempts (and this one): resume from here."""
        return self._processed

    @property
    def total(self) -> int | None:
        return self._total

    @property
    def worker_id(self) -> str:
        return self._worker.id

    # -- control ----------------------------------------------------------------------------

    def check(self) -> None:
        """Renew once a third of the lease has passed, run the control query once
        `control_interval` has passed, and raise `Aborted(reason)` if the signal tripped."""
        self.poke()
        if self.signal.reason is not None:
            raise Aborted(self.signal.reason)

    def poke(self) -> None:
        """`check()` without raising: does the bookkeeping and trips the signal if needed."""
        if self.signal.tripped:
            return
        now = self._clock()
        if self._deadline is not None and now >= self._deadline:
            self.signal.trip("timeout")
            return
        reason = self._worker.shutdown_reason(now)
        if reason is not None:
            self.signal.trip(reason)
            return
        if now - self.last_renewal >= self._renew_every:
            self._renew(now)
        elif now - self._last_control >= self._control_every:
            self._control(now)
        self._worker.beat(self)

    def _lease_conn(self) -> Conn:
        return self._tx_conn if self._tx_conn is not None else self._worker.control_conn()

    def _guard(self, now: float, exc: BaseException) -> None:
        """A renewal or control query failed with a database error. Keep going while the lease
        is surely still ours; trip `lost` before it could have expired in database time."""
        if not is_transient(exc):
            raise exc
        self._worker.drop_control_conn()
        log.event("lease_check_failed", run_id=self.claim.id, error=log.first_line(exc))
        if now - self.last_renewal >= self.claim.lease_seconds * 0.9:
            self._lost("renewal failed until the lease ran out")

    def _lost(self, why: str) -> None:
        self.signal.trip("lost")
        log.event("lease_lost", run_id=self.claim.id, owner=str(self.claim.owner), why=why)

    def _renew(self, now: float) -> None:
        try:
            expires = lease.renew(self._lease_conn(), self.claim)
        except psycopg.Error as exc:
            self._guard(now, exc)
            return
        self._last_control = now
        self._worker.drain_notifies()
        if expires is None:
            self._lost("renewal matched no row")
        else:
            self.last_renewal = now

    def _control(self, now: float) -> None:
        try:
            state = lease.control(self._lease_conn(), self.claim)
        except psycopg.Error as exc:
            self._guard(now, exc)
            return
        self._last_control = now
        self._worker.drain_notifies()
        if state == "lost":
            self._lost("control query matched no row")
        elif state == "cancelled":
            self.signal.trip("cancelled")
            log.event("cancel_seen", run_id=self.claim.id)
        elif state == "expired":
            self._renew(now)

    # -- progress ---------------------------------------------------------------------------

    def set_total(self, total: int) -> None:
        """Record how many units the run has in all (drawn as a progress bar)."""
        self.checkpoint(self._processed, total)

    def checkpoint(self, processed: int, total: int | None = None) -> None:
        """Record `processed` units done (owner-scoped; renews the lease). Inside
        `ctx.transaction()` it commits together with the step's effects."""
        if processed < 0 or (total is not None and total < 0):
            raise ValueError("checkpoint units must be >= 0")
        in_tx = self._tx_conn is not None
        now = self._clock()
        try:
            ok = lease.checkpoint(self._lease_conn(), self.claim, processed, total)
        except psycopg.Error as exc:
            if in_tx:
                raise
            self._guard(now, exc)
            self.check()
            return
        if not ok:
            self._lost("checkpoint matched no row")
            if in_tx:
                raise LeaseLost(f"run {self.claim.id} is no longer ours")
            raise Aborted("lost")
        self.last_renewal = now
        self._processed = processed
        if total is not None:
            self._total = total

    # -- effects ----------------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[Conn]:
        """A fenced transaction for effects: verifies and locks ownership of the run first and
        raises `LeaseLost` before anything is written if the run is no longer ours. Commits on
        a clean exit, rolls back on an exception."""
        if self._tx_conn is not None:
            raise RuntimeError("ctx.transaction() does not nest")
        if self.signal.reason == "lost":
            raise LeaseLost(f"run {self.claim.id} is no longer ours")
        # Checkpoints and renewals made inside commit or roll back with the effects; if they roll
        # back, so must our idea of progress, or a handler resuming from ctx.processed would skip
        # the step whose effect was just undone.
        saved = (self._processed, self._total, self.last_renewal)
        committed = False
        try:
            with self._worker.pool_connection() as conn, conn.transaction():
                if not lease.fence(conn, self.claim):
                    self._lost("fence matched no row")
                    raise LeaseLost(f"run {self.claim.id} is no longer ours")
                self._tx_conn = conn
                try:
                    yield conn
                finally:
                    self._tx_conn = None
            committed = True
        finally:
            if not committed:
                self._processed, self._total, self.last_renewal = saved

    @contextmanager
    def connection(self) -> Iterator[Conn]:
        """A pooled connection for reads (autocommit). Write effects through `transaction()`."""
        with self._worker.pool_connection() as conn:
            yield conn


def describe_error(exc: BaseException, limit: int = 8) -> str:
    """`Type: message` plus the tail of the traceback, for the run's history."""
    head = f"{type(exc).__name__}: {exc}"
    tail = "".join(traceback.format_exception(exc)[-limit:])
    text = head if not tail else f"{head}\n{tail}"
    return log.redact_dsn(text)[-4000:]
