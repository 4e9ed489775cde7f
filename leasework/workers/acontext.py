"""An async handler's view of its run (`async def handler(ctx, payload)`): the same run, lease
and abort signal as `Context`, with the database work awaited on the worker's async pool:
`await ctx.check()`, `await ctx.checkpoint(n)`, `async with ctx.transaction() as conn`.

Its lease is kept by the worker's keeper thread like any other. A run that must stop (cancel,
timeout, lost lease, shutdown) has its asyncio task cancelled (workers/aexecutor.py): the handler
sees `CancelledError` at the await it is suspended in, whether or not it ever awaits `check()`.
Never inside leasework's own statements: a cancel that arrives while one is in flight waits for
the handler's next await of its own (`deliver`), so a pool connection is never given back half-way
through the protocol and a fenced transaction never ends without its commit or rollback."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, nullcontext, suppress
from typing import Any, Protocol

import orjson
import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool

from .. import log
from ..errors import Aborted, LeaseLost, is_transient
from ..leases import lease
from ..leases.lease import Claim
from .context import RunFacts, T
from .keeper import Held
from .parents import QUERY as PARENTS
from .parents import Parents, parents_of

AConn = psycopg.AsyncConnection[Any]

__all__ = ["AsyncContext"]


class AsyncAttemptHost(Protocol):
    """What an async context needs of whoever runs its attempt (the async executor)."""

    worker_id: str

    async def apool(self) -> AsyncConnectionPool[Any]: ...


async def adiscard_if_busy(conn: AConn) -> bool:
    """After a cancel: a connection left in the middle of a query (or broken) is cancelled
    server-side and closed, so the pool drops it. True if it was discarded."""
    if conn.closed:
        return True
    if not conn.broken and conn.info.transaction_status != TransactionStatus.ACTIVE:
        return False
    with suppress(Exception):
        await conn.cancel_safe(timeout=1.0)
    with suppress(Exception):
        await conn.close()
    return True


class AsyncContext(RunFacts):
    """Passed to every `async def` handler as its first argument."""

    _runner: AsyncAttemptHost

    def __init__(
        self,
        claim: Claim,
        runner: AsyncAttemptHost,
        held: Held,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(claim, held, clock)
        self._runner = runner
        self._tx_conn: AConn | None = None
        self._parents: Parents | None = None
        # The task running the handler (set by the executor). Cancelled at most once, never while
        # leasework's own statements are in flight (`_shield` > 0 defers it).
        self.task: asyncio.Task[Any] | None = None

    # -- control ----------------------------------------------------------------------------

    async def check(self) -> None:
        """Raise `Aborted(reason)` if the run was cancelled, lost its lease, timed out or is being
        shut down; else give the other runs of this worker a turn. The keeper thread does the
        lease work; this only reads what it found."""
        if self.signal.reason is not None:
            self._raised = True
            raise Aborted(self.signal.reason)
        await asyncio.sleep(0)

    def deliver(self) -> None:
        """On the event loop, while the handler's task is suspended: cancel the task if its run
        must stop. Once; while the task waits inside leasework's own statement, at the end of it
        (the handler's next await)."""
        task = self.task
        if task is None or task.done() or self._raised or not self.signal.tripped:
            return
        if self._shield:
            self._pending = True
            return
        self._pending = False
        self._raised = True
        task.cancel(msg=f"leasework: run {self.claim.id} {self.signal.reason}")

    @contextmanager
    def _shielded(self) -> Iterator[None]:
        self._shield += 1
        try:
            yield
        finally:
            self._shield -= 1
            if self._shield == 0 and self._pending:
                self._pending = False
                # Delivered once the task is suspended again: at an await of the handler's own,
                # or, if that is one of ours, deferred once more.
                with suppress(RuntimeError):
                    asyncio.get_running_loop().call_soon(self.deliver)

    def _lost(self, why: str) -> None:
        if self.signal.reason != "lost":
            self.signal.reason = "lost"
            log.event("lease_lost", run_id=self.claim.id, owner=str(self.claim.owner), why=why)

    # -- progress ---------------------------------------------------------------------------

    async def set_total(self, total: int) -> None:
        """Record how many units the run has in all (drawn as a progress bar)."""
        await self.checkpoint(self._processed, total)

    async def checkpoint(self, processed: int, total: int | None = None) -> None:
        """Record `processed` units done (owner-scoped; renews the lease). Inside
        `ctx.transaction()` it commits together with the step's effects."""
        if processed < 0 or (total is not None and total < 0):
            raise ValueError("checkpoint units must be >= 0")
        tx = self._tx_conn
        now = self._clock()
        ok: bool | None
        with self._shielded():
            try:
                if tx is not None:
                    ok = await lease.acheckpoint(tx, self.claim, processed, total)
                else:
                    pool = await self._runner.apool()
                    async with pool.connection() as conn:
                        ok = await lease.acheckpoint(conn, self.claim, processed, total)
            except psycopg.Error as exc:
                if tx is not None or not is_transient(exc):
                    raise
                # Progress is not lost (the next checkpoint writes it); the keeper decides when
                # the lease is gone.
                log.event(
                    "checkpoint_failed", level=30, run_id=self.claim.id, error=log.first_line(exc)
                )
                ok = None
        if ok is None:
            await self.check()
            return
        if not ok:
            self._lost("checkpoint matched no row")
            if tx is not None:
                raise LeaseLost(f"run {self.claim.id} is no longer ours")
            self._raised = True
            raise Aborted("lost")
        if tx is None:  # renewed and committed; inside a transaction only once it commits
            self.held.renewed = max(self.held.renewed, now)
        self._processed = processed
        if total is not None:
            self._total = total

    # -- dependencies -----------------------------------------------------------------------

    async def parents(self) -> Parents:
        """`Context.parents`, awaited: the runs this run waited for, one query on the first
        call."""
        if self._parents is None:
            async with self.connection() as conn:
                cur = await conn.execute(PARENTS, {"id": self.claim.id})
                self._parents = parents_of(await cur.fetchall())
        return self._parents

    # -- durable steps ----------------------------------------------------------------------

    async def step(
        self, name: str, fn: Callable[..., T | Awaitable[T]], /, *args: Any, **kwargs: Any
    ) -> T:
        """`Context.step` for an async handler: `await ctx.step(name, fn, *args)`, `fn` a plain
        function or a coroutine function (awaited). Stored once per run, read back by every
        later attempt instead of calling `fn`; inside `async with ctx.transaction()` the record
        commits with the transaction's effects."""
        self._step_begin(name)
        tx = self._tx_conn
        try:
            if self._steps is None:
                with self._shielded():
                    if tx is not None:
                        self._steps = await lease.aload_steps(tx, self.claim)
                    else:
                        pool = await self._runner.apool()
                        async with pool.connection() as conn:
                            self._steps = await lease.aload_steps(conn, self.claim)
            stored = self._step_stored(name)
            if stored is not None:
                return orjson.loads(stored)  # type: ignore[no-any-return]
            value = fn(*args, **kwargs)
            if inspect.isawaitable(value):
                value = await value
        except BaseException:
            self._steps_used.discard(name)
            raise
        data = self._step_encode(name, value)
        with self._shielded():
            try:
                if tx is not None:
                    ok = await lease.astore_step(tx, self.claim, name, data)
                else:
                    pool = await self._runner.apool()
                    async with pool.connection() as conn:
                        ok = await lease.astore_step(conn, self.claim, name, data)
            except BaseException:
                self._steps_used.discard(name)
                raise
        if not ok:
            self._lost("step matched no row")
            if tx is not None:
                raise LeaseLost(f"run {self.claim.id} is no longer ours")
            self._raised = True
            raise Aborted("lost")
        return self._step_kept(name, data, tx is not None)  # type: ignore[no-any-return]

    # -- effects ----------------------------------------------------------------------------

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AConn]:
        """A fenced transaction for effects, on a connection of the worker's async pool: verifies
        and locks ownership of the run first and raises `LeaseLost` before anything is written if
        the run is no longer ours. Commits on a clean exit, rolls back on an exception."""
        if self._tx_conn is not None:
            raise RuntimeError("ctx.transaction() does not nest")
        if self.signal.reason == "lost":
            raise LeaseLost(f"run {self.claim.id} is no longer ours")
        saved = (self._processed, self._total)
        async with self._pooled() as conn:
            block = conn.transaction()
            entered = False
            try:
                with self._shielded():
                    await block.__aenter__()
                    entered = True
                    if not await lease.afence(conn, self.claim):
                        self._lost("fence matched no row")
                        raise LeaseLost(f"run {self.claim.id} is no longer ours")
                self._tx_conn = conn
                try:
                    yield conn
                finally:
                    self._tx_conn = None
                with self._shielded():
                    await block.__aexit__(None, None, None)  # commit
                self._steps_committed()
            except BaseException as exc:
                self._processed, self._total = saved
                self._steps_rolled_back()
                with self._shielded():
                    busy = await adiscard_if_busy(conn)
                    if entered and not conn.closed:
                        with suppress(Exception) if busy else nullcontext():
                            await block.__aexit__(type(exc), exc, exc.__traceback__)
                raise

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[AConn]:
        """A pooled async connection for reads (autocommit). Write effects through
        `transaction()`."""
        async with self._pooled() as conn:
            try:
                yield conn
            except BaseException:
                with self._shielded():
                    await adiscard_if_busy(conn)
                raise

    @asynccontextmanager
    async def _pooled(self) -> AsyncIterator[AConn]:
        """A connection of the worker's async pool, taken and given back where no cancel can
        land half-way (the pool would lose track of it)."""
        with self._shielded():
            pool = await self._runner.apool()
            conn = await pool.getconn()
        try:
            yield conn
        finally:
            with self._shielded():
                await pool.putconn(conn)
