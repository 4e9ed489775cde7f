"""A worker's connections: the control connection (claims, outcomes, checkpoints, LISTEN), the
pool for handlers and stages, and the NOTIFYs read on the control connection. Opened after any
fork, reopened when broken. Never runs job code and writes nothing itself."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import orjson
import psycopg
from psycopg.types.json import set_json_loads
from psycopg_pool import ConnectionPool

from .. import db, log
from ..config import Config

Conn = psycopg.Connection[Any]


class Connections:
    def __init__(self, config: Config, name: str, wanted: Callable[[str], bool]) -> None:
        self.config = config
        self.name = name
        # Which NOTIFY payloads are worth remembering (those a stage of this worker serves).
        self._wanted = wanted
        self._pool: ConnectionPool[Any] | None = None
        self._control: Conn | None = None
        self._listening = False
        # Payloads of the NOTIFYs received since the run loop last looked (a task kind, or
        # `upload`): at most one entry per payload, however many enqueues sent them.
        self.woken: set[str] = set()

    def open(self) -> None:
        """Open the control connection, check the schema, then the pool (pool_size - 1
        connections): a bad or missing database fails on the first connection, in one line,
        instead of in the pool's retries."""
        db.check_schema(self.control())
        if self._pool is None:
            self._pool = db.make_pool(
                self.config.dsn, self.config.pool_size - 1, f"leasework:{self.name}"
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self.drop_control()

    def control(self) -> Conn:
        """The connection reserved for leasework's own statements and LISTEN; reopened if it
        broke."""
        if self._control is None or self._control.closed or self._control.broken:
            self.drop_control()
            self._control = db.connect(
                self.config.dsn, application_name=f"leasework:{self.name}:control"
            )
            # Only leasework's own statements run here (claim, settle, outcomes, checkpoints),
            # each a prepared statement whose generic plan is as good as a custom one: planning
            # the claim afresh on every call cost more than executing it (bench/README.md).
            self._control.execute("SET plan_cache_mode = force_generic_plan")
            # Payloads and results decode with orjson, as they were encoded.
            set_json_loads(orjson.loads, self._control)
            self._listening = False
        return self._control

    def drop_control(self) -> None:
        if self._control is not None:
            with suppress(Exception):
                self._control.close()
        self._control = None
        self._listening = False

    def pool(self) -> ConnectionPool[Any]:
        """The pool of connections for handlers and stages (opened on first use)."""
        if self._pool is None:
            self.open()
        assert self._pool is not None
        return self._pool

    @contextmanager
    def pooled(self) -> Iterator[Conn]:
        with self.pool().connection() as conn:
            yield conn

    # -- NOTIFY -----------------------------------------------------------------------------

    def _note(self, payload: str) -> None:
        """Remember a payload this worker serves. Any NOTIFY still ends an idle wait (the
        supervisor's fast release sends one without a kind)."""
        if self._wanted(payload):
            self.woken.add(payload)

    def drain_notifies(self) -> None:
        """Move the NOTIFYs psycopg kept while the control connection was busy (it holds every
        one it reads during a claim or a checkpoint) into `woken`. Called after each poll and
        each checkpoint: a busy worker under a steady stream of enqueues would otherwise hold
        one object per enqueue until it next slept, and then wake once for each."""
        conn = self._control
        if conn is None or not self._listening or conn.closed or conn.broken:
            return
        try:
            for note in conn.notifies(timeout=0):
                self._note(note.payload)
        except psycopg.Error as exc:
            log.event("listen_failed", level=30, error=log.first_line(exc))
            self.drop_control()

    def take_woken(self) -> set[str]:
        woken, self.woken = self.woken, set()
        return woken

    def idle_wait(self, seconds: float) -> set[str]:
        """The payloads received since the last call, waiting up to `seconds` for one when there
        are none yet; empty on a timeout. Re-LISTENs after a reconnect."""
        if not self.woken:
            self._wait_for_notify(seconds)
        return self.take_woken()

    def _wait_for_notify(self, seconds: float) -> None:
        try:
            conn = self.control()
            if not self._listening:
                conn.execute(f"LISTEN {db.NOTIFY_CHANNEL}")
                self._listening = True
            # Consumed to the end: with stop_after=1 psycopg still yields the rest of the packet
            # that brought the first one, which would otherwise be lost.
            for note in conn.notifies(timeout=seconds, stop_after=1):
                self._note(note.payload)
        except (psycopg.Error, db.DatabaseUnavailable) as exc:
            # Reconnecting fails with DatabaseUnavailable while the server is down (a restart):
            # the idle worker waits and tries again, as a busy one does.
            log.event("listen_failed", level=30, error=log.first_line(exc))
            self.drop_control()
            time.sleep(min(seconds, 1.0))
