"""A worker's connections: its main connection (claims, outcomes, checkpoints, the stages' own
statements, LISTEN) and the pool for handlers. Opened after any fork, reopened when broken.
Never runs job code and writes nothing itself; how NOTIFYs wake an idle worker is wakeup.py's.

The budget per worker process: the main connection (also lent to a handler's
`ctx.transaction()`, `borrow`), its keeper's (workers/keeper.py), opened for the first lease it
renews, and the pool's, opened only when a handler needs one the main connection cannot be
(`ctx.connection()`, a transaction while it is lent) and closed after POOL_MAX_IDLE idle: 1 idle,
2 while running handlers, at most `pool_size + 1`; plus one for LISTEN behind a pooler with
`listen_dsn` under no supervisor (wakeup.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import orjson
import psycopg
from psycopg.pq import TransactionStatus
from psycopg.types.json import set_json_loads
from psycopg_pool import ConnectionPool

from .. import db
from ..config import Config
from .wakeup import Wakeup

Conn = psycopg.Connection[Any]


class Connections:
    def __init__(self, config: Config, name: str, wanted: Callable[[str], bool]) -> None:
        self.config = config
        self.name = name
        self._pool: ConnectionPool[Any] | None = None
        self._main: Conn | None = None
        self._lent = False  # the main connection is lent to a stage (`pooled()`)
        # How NOTIFYs wake the idle worker (on the main connection, or behind a pooler on
        # listen_dsn's or the parent's relay): `wanted` says which payloads a stage of it serves.
        self.wake = Wakeup(self, wanted)
        # The main connection's lock_timeout and statement_timeout from before leasework
        # bounded them (db.bound_waits), for a handler's transaction on it (lease.fence); None:
        # not bounded (behind a pooler), nothing to give back.
        self.handler_waits: tuple[str, str] | None = None

    def open(self) -> None:
        """Open the main connection, check the schema, then the pool (up to pool_size - 1
        connections, none opened yet): a bad or missing database fails on the first connection,
        in one line, instead of in the pool's retries."""
        db.check_schema(self.main())
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
        self.drop_main()
        self.wake.close()

    def main(self) -> Conn:
        """The main connection: the main thread's, reserved for leasework's own statements and
        LISTEN; reopened if it broke."""
        if self._main is None or self._main.closed or self._main.broken:
            self.drop_main()
            self._main = db.connect(
                self.config.dsn,
                # Its role in pg_stat_activity keeps the name `control`: operators' queries and
                # the tests find a worker's sessions by it.
                application_name=f"leasework:{self.name}:control",
                pooler=self.config.pooler,
            )
            if not db.is_pooled(self._main):
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
                self._main.execute(
                    "SELECT set_config('plan_cache_mode', 'force_generic_plan', false),"
                    " set_config('jit', 'off', false), set_config('enable_seqscan', 'off', false)"
                )
            # A transaction of leasework's own here (a stage's; a handler's is fenced, bounded by
            # its run's lease) left idle longer than a lease is ended by the server.
            self.handler_waits = db.bound_waits(
                self._main,
                self.config.lock_timeout,
                self.config.statement_timeout,
                idle_timeout=self.config.lease,
            )
            # Payloads and results decode with orjson, as they were encoded.
            set_json_loads(orjson.loads, self._main)
        return self._main

    def current(self) -> Conn | None:
        """The main connection as it stands, without opening it: None when it is not open (never
        opened, or dropped); it may have closed or broken since."""
        return self._main

    @property
    def behind_pooler(self) -> bool:
        """Whether the main connection goes through a pooler (opens it if needed)."""
        return db.is_pooled(self.main())

    def drop_main(self) -> None:
        if self._main is not None:
            with suppress(Exception):
                self._main.close()
        self._main = None

    def pool(self) -> ConnectionPool[Any]:
        """The pool of connections for handlers and stages (opened on first use)."""
        if self._pool is None:
            self.open()
        assert self._pool is not None
        return self._pool

    @contextmanager
    def pooled(self) -> Iterator[Conn]:
        """A connection for a stage's own statements: the main connection, which nothing else
        uses while a stage steps (the main thread runs one thing at a time), so an idle worker
        holds no pool connection; a pool connection if it is lent already (a nested call).
        Given back with no transaction open."""
        if self._lent:
            with self.pool().connection() as conn:
                yield conn
            return
        conn = self.main()
        self._lent = True
        set_json_loads(json.loads, conn)  # as on a pool connection: stages read what users wrote
        try:
            yield conn
        finally:
            self.give_back(conn, lent=True)

    def borrow(self) -> tuple[Conn, bool]:
        """A connection for a handler's fenced transaction, and whether it is the main
        connection: that one when it is open and free (the main thread runs the handler, so no
        claim, outcome or stage needs it meanwhile; a checkpoint inside the transaction goes
        on the transaction's connection), with the stdlib's JSON loader as on every connection
        a handler gets; else one of the pool's. Give it back with `give_back`."""
        conn = self._main
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
        """After `borrow`: a pool connection back to the pool; the main connection back to
        leasework's own statements (rolled back or dropped if left in a transaction)."""
        if not lent:
            self.pool().putconn(conn)
            return
        self._lent = False
        if not conn.closed and not conn.broken:
            set_json_loads(orjson.loads, conn)
        self._give_back(conn)

    def _give_back(self, conn: Conn) -> None:
        """The main connection back from a stage: a transaction it left open is rolled back;
        one left in the middle of a statement, or broken, is dropped (reopened on next use)."""
        if conn.closed or conn.broken:
            self.drop_main()
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
        self.drop_main()
