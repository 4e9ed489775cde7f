"""The handler's view of its run: the abort signal, `check()`, progress checkpoints and the fenced
transaction for effects. The lease is kept by the worker's keeper (workers/keeper.py), on its own
thread and connection, whether or not the handler ever calls `check()`; `check()` is the cheap
cooperative point (progress, early exit).

A run that must stop is interrupted: `Aborted` is raised in the handler at its next bytecode.
Never inside leasework's own statements (they are shielded, the interruption deferred to their
end), and a pooled connection interrupted in the middle of the handler's own query is discarded,
never handed back half-way through the protocol."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from typing import Any, Protocol, TypeVar

import orjson
import psycopg
from psycopg.pq import TransactionStatus

from .. import log
from ..encoding import check_json
from ..errors import Aborted, LeaseLost, PayloadError, ResultError, is_transient
from ..leases import lease
from ..leases.lease import Claim
from .connections import Connections
from .keeper import AbortSignal, Held, Keeper
from .parents import QUERY as PARENTS
from .parents import Parents, parents_of

Conn = psycopg.Connection[Any]

__all__ = ["AbortSignal", "Context", "RunFacts", "describe_error"]

T = TypeVar("T")

STEP_NAME_MAX = 200  # characters of a durable step's name (run_steps' CHECK)


def discard_if_busy(conn: Conn) -> bool:
    """After an interruption: a connection left in the middle of a query (or broken) is cancelled
    server-side and closed, so the pool drops it. True if it was discarded."""
    if conn.closed:
        return True
    if not conn.broken and conn.info.transaction_status != TransactionStatus.ACTIVE:
        return False
    with suppress(Exception):
        conn.cancel_safe(timeout=1.0)
    with suppress(Exception):
        conn.close()
    return True


class _Named(Protocol):
    worker_id: str


class RunFacts:
    """What a handler reads of its run, the same in `Context` and the async `AsyncContext`: the
    claim's facts and the progress so far."""

    claim: Claim
    held: Held
    _processed: int
    _total: int | None
    _runner: _Named

    def __init__(self, claim: Claim, held: Held, clock: Callable[[], float]) -> None:
        self.claim = claim
        self.held = held
        self.signal = held.signal
        self.result: Any = claim.result
        self._clock = clock
        self.started = clock()
        self._processed = claim.processed_units
        self._total = claim.total_units
        # Interruption: only while the handler's own code runs, at most once, never inside
        # leasework's statements (`_shield` > 0 defers it to their end).
        self._shield = 0
        self._pending = False
        self._raised = False  # the handler has been told
        # Durable steps (ctx.step): the values stored for this run, name -> JSON text, read at
        # the first step of the attempt (None: not yet, and a run without steps pays nothing
        # more); the names this attempt used; those stored inside the open fenced transaction,
        # kept only once it commits.
        self._steps: dict[str, str] | None = None

    @property
    def last_renewal(self) -> float:
        """Monotonic time the last renewal of this run's lease was sent."""
        return self.held.renewed

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
        return self._runner.worker_id

    # -- durable steps: the bookkeeping shared by Context.step and AsyncContext.step ----------

    _steps_used: set[str]
    _steps_pending: dict[str, str]

    def _step_begin(self, name: object) -> None:
        """Refuse a name that is no step name, or one this attempt used already."""
        if "_steps_used" not in self.__dict__:
            self._steps_used = set()
            self._steps_pending = {}
        if not isinstance(name, str) or not 1 <= len(name) <= STEP_NAME_MAX:
            raise ValueError(
                f"ctx.step(name, fn): name must be a string of 1 to {STEP_NAME_MAX} characters, "
                f"got {name!r}"
            )
        if name in self._steps_used:
            raise ValueError(
                f"ctx.step({name!r}) was already called in this attempt: each step of a run needs "
                "a name of its own (for a loop, put the item in it: f'page-{n}')"
            )
        self._steps_used.add(name)

    def _step_stored(self, name: str) -> str | None:
        """The value stored for `name` (JSON text), by this attempt or an earlier one."""
        assert self._steps is not None
        return self._steps_pending.get(name, self._steps.get(name))

    def _step_encode(self, name: str, value: Any) -> lease.JsonText:
        """A step's value as JSON text, checked as results are (ResultError if it cannot be
        stored: the attempt fails like any handler error)."""
        try:
            data = check_json(f"the value of step {name!r}", value, lease.RESULT_CEILING)
        except PayloadError as exc:
            self._steps_used.discard(name)
            raise ResultError(str(exc)) from None
        return lease.JsonText(data.decode())

    def _step_kept(self, name: str, data: str, in_transaction: bool) -> Any:
        """After the step's row was written: remember it (inside a fenced transaction, only once
        that commits) and return the value as a later attempt would read it."""
        data = str.__str__(data)  # a plain str: orjson refuses a subclass (lease.JsonText)
        if in_transaction:
            self._steps_pending[name] = data
        else:
            assert self._steps is not None
            self._steps[name] = data
        return orjson.loads(data)

    def _steps_committed(self) -> None:
        if self._steps is not None and self._steps_pending:
            self._steps.update(self._steps_pending)
            self._steps_pending.clear()

    def _steps_rolled_back(self) -> None:
        """The steps stored inside a fenced transaction that rolled back were never stored: their
        names may be used again in this attempt."""
        if self._steps is not None and self._steps_pending:
            self._steps_used.difference_update(self._steps_pending)
            self._steps_pending.clear()


class AttemptHost(Protocol):
    """What a context needs of whoever runs its attempt (the executor): the worker's id, its
    keeper and connections, and the liveness beat."""

    worker_id: str
    keeper: Keeper
    conns: Connections

    def beat(self, ctx: Context | None) -> None: ...


class Context(RunFacts):
    """Passed to every handler as its first argument."""

    _runner: AttemptHost

    def __init__(
        self,
        claim: Claim,
        runner: AttemptHost,
        held: Held,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(claim, held, clock)
        self._runner = runner
        self._tx_conn: Conn | None = None
        self._parents: Parents | None = None
        self.interruptible = False  # the handler's own code runs (interruptions land only then)

    # -- control ----------------------------------------------------------------------------

    def check(self) -> None:
        """Raise `Aborted(reason)` if the run was cancelled, lost its lease, timed out or is being
        shut down. Also runs whatever lease work is due at once (the keeper does it anyway)."""
        self.refresh()
        if self.signal.reason is not None:
            # Told here: the keeper's interrupt (at most one Aborted raised asynchronously) must
            # not land a second one where a handler that caught this one is cleaning up.
            self._raised = True
            raise Aborted(self.signal.reason)

    def refresh(self) -> None:
        """`check()` without raising: does the bookkeeping and trips the signal if needed."""
        with self._shielded():
            self._runner.keeper.tend(self._clock(), wait=False)
        self._runner.beat(self)

    def interrupt(self) -> None:
        """Called in the main thread by the worker's interrupt signal: raise `Aborted` into the
        handler if its run must stop. Once; inside leasework's own statements, at their end."""
        if not self.signal.tripped or not self.interruptible or self._raised:
            return
        if self._shield:
            self._pending = True
            return
        self._raised = True
        raise Aborted(self.signal.reason or "shutdown")

    @contextmanager
    def _shielded(self) -> Iterator[None]:
        self._shield += 1
        try:
            yield
        finally:
            self._shield -= 1
        if self._shield == 0 and self._pending and self.interruptible and not self._raised:
            self._pending = False
            self._raised = True
            raise Aborted(self.signal.reason or "shutdown")

    def _lost(self, why: str) -> None:
        if self.signal.reason != "lost":
            self.signal.reason = "lost"
            log.event("lease_lost", run_id=self.claim.id, owner=str(self.claim.owner), why=why)

    # -- progress ---------------------------------------------------------------------------

    def set_total(self, total: int) -> None:
        """Record how many units the run has in all (drawn as a progress bar)."""
        self.checkpoint(self._processed, total)

    def checkpoint(self, processed: int, total: int | None = None) -> None:
        """Record `processed` units done (owner-scoped; renews the lease). Inside
        `ctx.transaction()` it commits together with the step's effects."""
        if processed < 0 or (total is not None and total < 0):
            raise ValueError("checkpoint units must be >= 0")
        tx = self._tx_conn
        now = self._clock()
        with self._shielded():
            try:
                conn = tx if tx is not None else self._runner.conns.main()
                ok = lease.checkpoint(conn, self.claim, processed, total)
            except psycopg.Error as exc:
                if tx is not None or not is_transient(exc):
                    raise
                # Progress is not lost (the next checkpoint writes it); the keeper decides when
                # the lease is gone.
                self._runner.conns.drop_main()
                log.event(
                    "checkpoint_failed", level=30, run_id=self.claim.id, error=log.first_line(exc)
                )
                ok = None
        if ok is None:
            self.check()
            return
        if not ok:
            self._lost("checkpoint matched no row")
            if tx is not None:
                raise LeaseLost(f"run {self.claim.id} is no longer ours")
            raise Aborted("lost")
        if tx is None:  # renewed and committed; inside a transaction only once it commits
            self.held.renewed = max(self.held.renewed, now)
            self._runner.conns.wake.drain_notifies()  # read with the checkpoint's answer
        self._processed = processed
        if total is not None:
            self._total = total

    # -- dependencies -----------------------------------------------------------------------

    def parents(self) -> Parents:
        """The runs this run waited for (`after=`; a batch's members for its callback), each
        with its kind, final status, result and error, by id; `.counts` for a batch's callback.
        One query, on the first call (docs/workflows.md)."""
        if self._parents is None:
            with self.connection() as conn:
                self._parents = parents_of(conn.execute(PARENTS, {"id": self.claim.id}))
        return self._parents

    # -- durable steps ----------------------------------------------------------------------

    def step(self, name: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` once per run: its return value (JSON, as results are) is
        stored in the run under `name`, and an attempt that finds it stored gets it back instead
        of calling `fn` again. The value returned is the stored one as JSON reads it back (a
        tuple comes back a list), the same in every attempt. Stored while the run is still ours
        (else `Aborted("lost")`, or inside `ctx.transaction()` `LeaseLost`); inside
        `ctx.transaction()` the step's record commits, or rolls back, with the transaction's
        effects. `fn` itself is at-least-once: an attempt that dies after `fn` returned and
        before the record committed calls it again in the next attempt. A name is used once per
        attempt (ValueError)."""
        self._step_begin(name)
        tx = self._tx_conn
        try:
            if self._steps is None:
                with self._shielded():
                    conn = tx if tx is not None else self._runner.conns.main()
                    self._steps = lease.load_steps(conn, self.claim)
            stored = self._step_stored(name)
            if stored is not None:
                return orjson.loads(stored)  # type: ignore[no-any-return]
            value = fn(*args, **kwargs)
        except BaseException:
            self._steps_used.discard(name)
            raise
        data = self._step_encode(name, value)
        with self._shielded():
            try:
                conn = tx if tx is not None else self._runner.conns.main()
                ok = lease.store_step(conn, self.claim, name, data)
            except psycopg.Error as exc:
                self._steps_used.discard(name)
                if tx is None and is_transient(exc):
                    self._runner.conns.drop_main()
                raise
        if not ok:
            self._lost("step matched no row")
            if tx is not None:
                raise LeaseLost(f"run {self.claim.id} is no longer ours")
            self._raised = True
            raise Aborted("lost")
        return self._step_kept(name, data, tx is not None)  # type: ignore[no-any-return]

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
        # Checkpoints made inside commit or roll back with the effects; if they roll back, so
        # must our idea of progress, or a handler resuming from ctx.processed would skip the step
        # whose effect was just undone.
        saved = (self._processed, self._total)
        with self._pooled(transaction=True) as conn:
            block = conn.transaction()
            tx: psycopg.Transaction | None = None
            try:
                with self._shielded():
                    tx = block.__enter__()
                    # The main connection's bounds on waits are leasework's, not the handler's.
                    waits = self._runner.conns.handler_waits
                    if not lease.fence(conn, self.claim, waits):
                        self._lost("fence matched no row")
                        raise LeaseLost(f"run {self.claim.id} is no longer ours")
                self._tx_conn = conn
                try:
                    yield conn
                finally:
                    self._tx_conn = None
                with self._shielded():
                    block.__exit__(None, None, None)  # commit
                self._steps_committed()
            except BaseException as exc:
                self._processed, self._total = saved
                self._steps_rolled_back()
                with self._shielded():
                    busy = discard_if_busy(conn)
                    if tx is not None and tx.status == tx.Status.ACTIVE:
                        with suppress(Exception) if busy else nullcontext():
                            block.__exit__(type(exc), exc, exc.__traceback__)  # roll back
                raise

    @contextmanager
    def connection(self) -> Iterator[Conn]:
        """A pooled connection for reads (autocommit). Write effects through `transaction()`."""
        with self._pooled() as conn:
            try:
                yield conn
            except BaseException:
                with self._shielded():
                    discard_if_busy(conn)
                raise

    @contextmanager
    def _pooled(self, *, transaction: bool = False) -> Iterator[Conn]:
        """A connection of the worker's pool (for a transaction, the main connection when it
        is free: Connections.borrow), taken and given back where no interruption can land
        half-way (the pool would lose track of it)."""
        conns = self._runner.conns
        with self._shielded():
            if transaction:
                conn, lent = conns.borrow()
            else:
                conn, lent = conns.pool().getconn(), False
        try:
            yield conn
        finally:
            with self._shielded():
                conns.give_back(conn, lent)


ERROR_MAX = 4000  # characters of an error's description kept in a run's history
_PIECE_MAX = 1000  # of its message, and of each entry of its traceback
_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def _exception_line(exc: BaseException) -> str:
    """The last line of a traceback (`module.Type: message`), its message cut first."""
    kind = type(exc).__qualname__
    if type(exc).__module__ not in ("builtins", "__main__"):
        kind = f"{type(exc).__module__}.{kind}"
    try:
        message = str(exc)
    except Exception:
        message = "<exception str() failed>"
    return log.clip(f"{kind}: {message}" if message else kind, _PIECE_MAX) + "\n"


def _traceback_tail(exc: BaseException, limit: int) -> list[str]:
    """The last `limit` entries of `traceback.format_exception(exc)` (frames, exception lines
    and the lines joining a chain), built from the end: never the whole chain nor a whole
    message (the standard library indents a message line by line, a second per million)."""
    backwards: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(backwards) < limit:
        seen.add(id(current))
        backwards.append(_exception_line(current))
        if current.__traceback__ is not None:
            frames = traceback.format_tb(current.__traceback__, -limit)
            backwards.extend(log.clip(f, _PIECE_MAX) for f in reversed(frames))
            backwards.append("Traceback (most recent call last):\n")
        if current.__cause__ is not None:
            backwards.append(_CAUSE)
            current = current.__cause__
        elif current.__context__ is not None and not current.__suppress_context__:
            backwards.append(_CONTEXT)
            current = current.__context__
        else:
            current = None
    return backwards[:limit][::-1]


def describe_error(exc: BaseException, limit: int = 8) -> str:
    """`Type: message` plus the tail of the traceback (its last `limit` entries), for the run's
    history: at most ERROR_MAX characters, passwords hidden. Each piece is cut to its head
    before it is scanned (`log.clip`), so a message of megabytes costs what its first thousand
    characters cost, not seconds with the GIL held (the lease keeper's thread starved with
    it)."""
    head = log.clip(f"{type(exc).__name__}: {exc}", _PIECE_MAX)
    tail = "".join(_traceback_tail(exc, limit))
    text = head if not tail else f"{head}\n{tail}"
    return text[-ERROR_MAX:]
