"""A worker's connections: the control connection (claims, outcomes, checkpoints, the stages' own
statements, LISTEN), the pool for handlers, and the NOTIFYs read on the control connection (or,
behind a pooler, on a direct connection to `listen_dsn`). Opened after any fork, reopened when
broken. Never runs job code and writes nothing itself.

The budget per worker process: the control connection (also lent to a handler's
`ctx.transaction()`, `borrow`), its keeper's (workers/keeper.py), opened for the first lease it
renews, and the pool's, opened only when a handler needs one the control connection cannot be
(`ctx.connection()`, a transaction while it is lent) and closed after POOL_MAX_IDLE idle: 1 idle,
2 while running handlers, at most `pool_size + 1`; plus one for LISTEN behind a pooler with
`listen_dsn` under no supervisor."""

from __future__ import annotations

import asyncio
import json
import os
import select
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import orjson
import psycopg
from psycopg.pq import TransactionStatus
from psycopg.types.json import set_json_loads
from psycopg_pool import ConnectionPool

from .. import db, log
from ..config import Config

Conn = psycopg.Connection[Any]
# The longest piece of an idle wait between two looks at whether the worker must stop.
WAIT_PIECE = 1.0


class Connections:
    def __init__(self, config: Config, name: str, wanted: Callable[[str], bool]) -> None:
        self.config = config
        self.name = name
        # Which NOTIFY payloads are worth remembering (those a stage of this worker serves).
        self._wanted = wanted
        self._pool: ConnectionPool[Any] | None = None
        self._control: Conn | None = None
        self._lent = False  # the control connection is lent to a stage (`pooled()`)
        # Behind a pooler: the direct connection LISTEN runs on (listen_dsn), if any.
        self._listener: Conn | None = None
        self._listen_refused = False  # listen_dsn turned out to be pooled too: poll instead
        # Under the supervisor with listen_dsn: the read end of the pipe where the parent relays
        # the NOTIFYs it hears on the host's one direct connection (supervisor/wakeup.py); used
        # instead of a connection of our own when behind a pooler.
        self.relay_fd: int | None = None
        self._listening = False
        self._wake_failed = False  # the last _wake_fd could not reach the database
        # Payloads of the NOTIFYs received since the run loop last looked (a task kind, or
        # `upload`): at most one entry per payload, however many enqueues sent them.
        self.woken: set[str] = set()
        # A NOTIFY naming nothing this worker serves (the supervisor's fast release sends
        # `reclaim`) ended the last idle wait: the worker then asks every stage.
        self.stray = False
        # The control connection's lock_timeout and statement_timeout from before leasework
        # bounded them (db.bound_waits), for a handler's transaction on it (lease.fence); None:
        # not bounded (behind a pooler), nothing to give back.
        self.handler_waits: tuple[str, str] | None = None

    def open(self) -> None:
        """Open the control connection, check the schema, then the pool (up to pool_size - 1
        connections, none opened yet): a bad or missing database fails on the first connection,
        in one line, instead of in the pool's retries."""
        db.check_schema(self.control())
        if self._pool is None:
            self._pool = db.make_pool(
                self.config.dsn,
                self.config.pool_size - 1,
                f"leasework:{self.name}",
                pooler=self.config.pooler,
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self.drop_control()
        self._drop_listener()

    def control(self) -> Conn:
        """The connection reserved for leasework's own statements and LISTEN; reopened if it
        broke."""
        if self._control is None or self._control.closed or self._control.broken:
            self.drop_control()
            self._control = db.connect(
                self.config.dsn,
                application_name=f"leasework:{self.name}:control",
                pooler=self.config.pooler,
            )
            if not db.is_pooled(self._control):
                # Only leasework's own statements run here (claim, settle, outcomes,
                # checkpoints, the stages'), each a prepared statement whose generic plan is as
                # good as a custom one: planning the claim afresh on every call cost more than
                # executing it (bench/README.md). Behind a pooler nothing is prepared, and a
                # session setting would land on whichever server session ran it. No JIT either:
                # these are short statements, and compiling one (when a generic plan's cost
                # estimate passes jit_above_cost) took longer than a thousand runs of it. And no
                # sequential scan where an index serves: a generic plan is kept until the table
                # is analyzed again, and one made while `runs` was empty (a worker started before
                # the first enqueue) scanned and sorted the whole queue on every claim once it
                # filled: 2-3 s per claim of 100 from 100,000 queued, until autovacuum's analyze
                # (never, with autovacuum off). Every statement here has an index to use;
                # ctx.transaction() puts the default back for the handler's own.
                self._control.execute(
                    "SELECT set_config('plan_cache_mode', 'force_generic_plan', false),"
                    " set_config('jit', 'off', false), set_config('enable_seqscan', 'off', false)"
                )
            self.handler_waits = db.bound_waits(
                self._control, self.config.lock_timeout, self.config.statement_timeout
            )
            # Payloads and results decode with orjson, as they were encoded.
            set_json_loads(orjson.loads, self._control)
            if self._listener is None:
                self._listening = False
        return self._control

    @property
    def behind_pooler(self) -> bool:
        """Whether the control connection goes through a pooler (opens it if needed)."""
        return db.is_pooled(self.control())

    def drop_control(self) -> None:
        if self._control is not None:
            with suppress(Exception):
                self._control.close()
        self._control = None
        if self._listener is None:
            self._listening = False

    def pool(self) -> ConnectionPool[Any]:
        """The pool of connections for handlers and stages (opened on first use)."""
        if self._pool is None:
            self.open()
        assert self._pool is not None
        return self._pool

    @contextmanager
    def pooled(self) -> Iterator[Conn]:
        """A connection for a stage's own statements: the control connection, which nothing else
        uses while a stage steps (the main thread runs one thing at a time), so an idle worker
        holds no pool connection; a pool connection if it is lent already (a nested call).
        Given back with no transaction open."""
        if self._lent:
            with self.pool().connection() as conn:
                yield conn
            return
        conn = self.control()
        self._lent = True
        set_json_loads(json.loads, conn)  # as on a pool connection: stages read what users wrote
        try:
            yield conn
        finally:
            self.give_back(conn, lent=True)

    def borrow(self) -> tuple[Conn, bool]:
        """A connection for a handler's fenced transaction, and whether it is the control
        connection: that one when it is open and free (the main thread runs the handler, so no
        claim, outcome or stage needs it meanwhile; a checkpoint inside the transaction goes
        on the transaction's connection), with the stdlib's JSON loader as on every connection
        a handler gets; else one of the pool's. Give it back with `give_back`."""
        conn = self._control
        if (
            self._lent
            or conn is None
            or conn.closed
            or conn.broken
            or conn.info.transaction_status != TransactionStatus.IDLE
        ):
            return self.pool().getconn(), False
        self._lent = True
        set_json_loads(json.loads, conn)
        return conn, True

    def give_back(self, conn: Conn, lent: bool) -> None:
        """After `borrow`: a pool connection back to the pool; the control connection back to
        leasework's own statements (rolled back or dropped if left in a transaction)."""
        if not lent:
            self.pool().putconn(conn)
            return
        self._lent = False
        if not conn.closed and not conn.broken:
            set_json_loads(orjson.loads, conn)
        self._give_back(conn)

    def _give_back(self, conn: Conn) -> None:
        """The control connection back from a stage: a transaction it left open is rolled back;
        one left in the middle of a statement, or broken, is dropped (reopened on next use)."""
        if conn.closed or conn.broken:
            self.drop_control()
            return
        state = conn.info.transaction_status
        if state == TransactionStatus.IDLE:
            return
        if state in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
            try:
                conn.rollback()
                return
            except psycopg.Error:
                pass
        self.drop_control()

    # -- NOTIFY -----------------------------------------------------------------------------

    def _note(self, payload: str) -> None:
        """Remember a payload this worker serves. Any NOTIFY still ends an idle wait (the
        supervisor's fast release sends one without a kind): another is `stray`."""
        if self._wanted(payload):
            self.woken.add(payload)
        else:
            self.stray = True

    @property
    def can_wake(self) -> bool:
        """Whether a NOTIFY can end this worker's idle wait: LISTEN on a direct control
        connection; behind a pooler, the parent's relay or a direct `listen_dsn`. False while the
        control connection is down (nothing is heard then either)."""
        if self.relay_fd is not None:
            return True
        conn = self._control
        if conn is None or conn.closed or conn.broken:
            return False
        if not db.is_pooled(conn):
            return True
        return bool(self.config.listen_dsn) and not self._listen_refused

    def listen(self) -> bool:
        """LISTEN now if this worker hears NOTIFYs and does not yet (its start, a reconnect):
        called before each poll, so that whatever the poll's statements do not see yet was
        committed after the LISTEN and is heard, though the idle wait after it is long. Whether
        it LISTENed only now: then that poll must ask every stage, since a NOTIFY sent before
        (a run enqueued while the connection was down) reached nobody."""
        if self._listening or self.relay_fd is not None:
            return False
        listener = False
        try:
            listener = self.behind_pooler
            return self._listen_on(self._listen_connection() if listener else self.control())
        except (psycopg.Error, db.DatabaseUnavailable) as exc:
            log.event("listen_failed", level=30, error=log.first_line(exc))
            if listener:
                self._drop_listener()
            else:
                self.drop_control()
            return False

    def _listen_on(self, conn: Conn | None) -> bool:
        """LISTEN on `conn` unless listening already; whether it did (then anything committed
        before went unheard: the caller polls before it waits)."""
        if conn is not None and not self._listening:
            conn.execute(f"LISTEN {db.NOTIFY_CHANNEL}")
            self._listening = True
            return True
        return False

    def drain_notifies(self) -> None:
        """Move the NOTIFYs psycopg kept while the control connection was busy (it holds every
        one it reads during a claim or a checkpoint) into `woken`. Called after each poll and
        each checkpoint: a busy worker under a steady stream of enqueues would otherwise hold
        one object per enqueue until it next slept, and then wake once for each."""
        if self.relay_fd is not None:
            self._read_relay()
        listener = self._listener is not None
        conn = self._listener if listener else self._control
        if conn is None or not self._listening or conn.closed or conn.broken:
            return
        try:
            for note in conn.notifies(timeout=0):
                self._note(note.payload)
        except psycopg.Error as exc:
            log.event("listen_failed", level=30, error=log.first_line(exc))
            if listener:
                self._drop_listener()
            else:
                self.drop_control()

    def take_woken(self) -> set[str]:
        woken, self.woken = self.woken, set()
        return woken

    def idle_wait(self, seconds: float, stop: Callable[[], bool] | None = None) -> set[str]:
        """The payloads received since the last call, waiting up to `seconds` for a NOTIFY when
        there are none yet; empty on a timeout or a stray NOTIFY (`stray` says which).
        Re-LISTENs after a reconnect. A long wait is made of waits of at most poll_interval (and
        a second), ended early once `stop()` is true: a worker told to stop leaves an idle sleep
        as soon as it did when idle workers slept poll_interval. Those waits send nothing to the
        server."""
        self.stray = False
        deadline = time.monotonic() + seconds
        piece = min(self.config.poll_interval, WAIT_PIECE)
        while not self.woken and not self.stray:
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop()):
                break
            if not self._wait_for_notify(min(left, piece)):
                break  # the connection failed: poll now, which reconnects
        return self.take_woken()

    def _wait_for_notify(self, seconds: float) -> bool:
        """Wait up to `seconds` for a NOTIFY; False if the worker must poll first: the
        connection failed, or it was reopened and LISTENs only now (a run enqueued while it was
        down, a server restart say, NOTIFYed nobody: the poll finds it)."""
        listener = False
        try:
            listener = self.behind_pooler
            if listener and self.relay_fd is not None:
                self._wait_for_relay(seconds)
                return True
            conn = self._listen_connection() if listener else self.control()
            if conn is None:
                # Behind a pooler without listen_dsn: a LISTEN would be left on whichever server
                # session ran it, heard by nobody. Polling is the wake-up.
                time.sleep(seconds)
                return True
            if self._listen_on(conn):
                self.stray = True  # what it missed may be any stage's: ask them all
                return False
            # Consumed to the end: with stop_after=1 psycopg still yields the rest of the packet
            # that brought the first one, which would otherwise be lost.
            for note in conn.notifies(timeout=seconds, stop_after=1):
                self._note(note.payload)
            return True
        except (psycopg.Error, db.DatabaseUnavailable) as exc:
            # Reconnecting fails with DatabaseUnavailable while the server is down (a restart):
            # the idle worker waits and tries again, as a busy one does.
            log.event("listen_failed", level=30, error=log.first_line(exc))
            if listener:
                self._drop_listener()
            else:
                self.drop_control()
            time.sleep(min(seconds, 1.0))
            return False

    async def idle_wait_async(self, seconds: float, also: asyncio.Event) -> set[str]:
        """`idle_wait` on the worker's event loop (async handlers): the loop watches the socket
        a NOTIFY arrives on (the control connection, `listen_dsn`'s, or the parent's relay pipe)
        while the runs in flight go on, and `also` ends the wait too (a run ended)."""
        self.drain_notifies()
        if self.woken or also.is_set():
            return self.take_woken()
        was_listening = self._listening
        fd = self._wake_fd()
        if self._wake_failed:
            seconds = min(seconds, 1.0)  # the connection failed: poll again soon, which reconnects
        elif fd is not None and not was_listening and self.relay_fd is None:
            self.stray = True  # it LISTENs only now: poll every stage first (_wait_for_notify)
            return self.take_woken()
        loop = asyncio.get_running_loop()
        heard = asyncio.Event()
        if fd is not None:
            loop.add_reader(fd, heard.set)
        waits = [asyncio.ensure_future(heard.wait()), asyncio.ensure_future(also.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            if fd is not None:
                with suppress(Exception):
                    loop.remove_reader(fd)
        if heard.is_set():
            self.drain_notifies()
        return self.take_woken()

    def _wake_fd(self) -> int | None:
        """The file descriptor a NOTIFY arrives on, LISTEN issued first if needed; None when
        there is none (behind a pooler without listen_dsn or relay: polling is the wake-up, or
        the database is unreachable for now)."""
        listener = False
        self._wake_failed = False
        try:
            listener = self.behind_pooler
            if listener and self.relay_fd is not None:
                return self.relay_fd
            conn = self._listen_connection() if listener else self.control()
            if conn is None:
                return None
            self._listen_on(conn)
            return conn.fileno()
        except (psycopg.Error, db.DatabaseUnavailable) as exc:
            self._wake_failed = True
            log.event("listen_failed", level=30, error=log.first_line(exc))
            if listener:
                self._drop_listener()
            else:
                self.drop_control()
            return None

    def _wait_for_relay(self, seconds: float) -> None:
        """Wait on the parent's wake pipe: any line ends the wait, as any NOTIFY does."""
        assert self.relay_fd is not None
        ready, _, _ = select.select([self.relay_fd], [], [], seconds)
        if ready:
            self._read_relay()

    def _read_relay(self) -> None:
        """The payloads the parent relayed, one per line, read without blocking. A closed pipe
        (the parent is gone: the child stops on its own) ends relaying: the worker polls."""
        assert self.relay_fd is not None
        data = b""
        while True:
            try:
                chunk = os.read(self.relay_fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                with suppress(OSError):
                    os.close(self.relay_fd)
                self.relay_fd = None
                break
            data += chunk
        for line in data.split(b"\n")[:-1]:
            self._note(line.decode(errors="replace"))

    def _listen_connection(self) -> Conn | None:
        """Behind a pooler: a direct connection to `listen_dsn` for LISTEN (reopened if it
        broke), or None when there is none (unset, or itself pooled)."""
        if not self.config.listen_dsn or self._listen_refused:
            return None
        conn = self._listener
        if conn is None or conn.closed or conn.broken:
            self._drop_listener()
            conn = db.connect(
                self.config.listen_dsn,
                application_name=f"leasework:{self.name}:listen",
                connect_timeout=db.HANG_CONNECT_TIMEOUT,
            )
            if db.is_pooled(conn):
                conn.close()
                self._listen_refused = True
                log.event(
                    "listen_dsn_pooled",
                    level=30,
                    error="listen_dsn goes through a pooler too: idle workers poll instead",
                )
                return None
            self._listener = conn
        return conn

    def _drop_listener(self) -> None:
        if self._listener is not None:
            with suppress(Exception):
                self._listener.close()
            self._listener = None
            self._listening = False
