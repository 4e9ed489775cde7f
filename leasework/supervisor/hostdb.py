"""The parent's only database duties: check the schema at boot, write its children's rows in the
workers table, and expire a reaped child's leases at once (fast release).

Holds at most one connection, opened lazily and closed before every fork, so no connection is
ever shared with a child. Every failure is logged and retried later, never raised into the
parent's loop: the database being down must not stop the supervisor from supervising.
"""

from __future__ import annotations

import contextlib
import random
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg

from .. import db, log
from ..config import Config
from ..leases import lease
from ..queries import load
from ..workers import presence
from ..workers.backoff import retry_delay
from . import policy

Q = load("leasework.supervisor", "hostdb.sql")

# After a failed attempt, wait this long before touching the database again, so a database
# outage costs the parent loop one short connect timeout per interval, not one per tick.
RETRY_AFTER = 2.0
CONNECT_TIMEOUT = db.HANG_CONNECT_TIMEOUT
# The parent's loop must never hang on its database connection: while it waits, its watchdog
# does not run, and a host cut off from the database would let its jobs run past their leases.
HANG_GUARD = db.HANG_GUARD


@dataclass(frozen=True)
class Row:
    worker_id: str
    pid: int
    run_id: int | None
    pool: presence.PoolRow = (None, None)


@dataclass(frozen=True)
class Killed:
    """The run of a child the parent killed because the run had to stop: its outcome is written
    by the parent (owner-scoped), not left to the lease."""

    run_id: int
    owner: uuid.UUID
    attempt: int
    reason: str  # cancelled, timeout, lost, shutdown


class HostDB:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.host = socket.gethostname()
        self._conn: psycopg.Connection[Any] | None = None
        self._retry_at = float("-inf")
        self._release: dict[str, str] = {}  # worker id -> reason, waiting to be written
        self._settle: dict[str, Killed] = {}  # worker id -> the run it was killed for
        self._stopped: set[str] = set()
        self._removed: set[str] = set()  # stopped cleanly: the row goes
        self._rand = random.Random()
        self.behind_pooler = False  # what its last connection found (db.is_pooled)

    # -- the connection ---------------------------------------------------------------------

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self.close()
            self._conn = db.connect(
                self.config.dsn,
                application_name="leasework:supervisor",
                connect_timeout=CONNECT_TIMEOUT,
                pooler=self.config.pooler,
                **HANG_GUARD,
            )
            self.behind_pooler = db.is_pooled(self._conn)
            db.bound_waits(
                self._conn,
                self.config.lock_timeout,
                self.config.statement_timeout,
                idle_timeout=self.config.lease,
            )
        return self._conn

    def close(self) -> None:
        """Close the connection (before every fork)."""
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None

    def _failed(self, what: str, exc: BaseException, now: float) -> None:
        log.event("ledger_failed", level=30, action=what, error=log.first_line(exc))
        self.close()
        self._retry_at = now + RETRY_AFTER

    def available(self, now: float) -> bool:
        return now >= self._retry_at

    # -- boot ---------------------------------------------------------------------------------

    def check_schema(self) -> None:
        """Raises SchemaMissing or ConfigError (boot errors), DatabaseUnavailable or a transient
        psycopg error (retry). Closes the connection afterwards: children are forked next."""
        try:
            db.check_schema(self._connection())
        finally:
            self.close()

    # -- workers rows and fast release --------------------------------------------------------

    def heartbeat(self, rows: list[Row], now: float) -> bool:
        """Upsert one row per child (heartbeat_at = database now). False if not written."""
        if not rows or not self.available(now):
            return False
        try:
            conn = self._connection()
            with conn.transaction():
                for row in rows:
                    presence.upsert_worker(
                        conn, row.worker_id, self.host, row.pid, row.run_id, row.pool
                    )
        except (psycopg.Error, db.DatabaseUnavailable) as exc:
            self._failed("heartbeat", exc, now)
            return False
        return True

    def child_gone(
        self,
        worker_id: str,
        release_reason: str | None,
        killed: Killed | None = None,
        *,
        clean: bool = False,
    ) -> None:
        """Record that a child exited; with a reason, its leases are expired too; `killed`: the
        run it was killed for gets its outcome (cancelled, a timed-out attempt, released).
        `clean` (it stopped on request or was recycled): its row is deleted, as a standalone
        worker deletes its own on a clean exit, so that `status` does not count it `gone`; a
        crashed or killed child's row stays, stopped, for maintenance to prune."""
        if release_reason is not None:
            self._release[worker_id] = release_reason
        if killed is not None:
            self._settle[worker_id] = killed
        if clean and release_reason is None and killed is None:
            self._removed.add(worker_id)
        else:
            self._stopped.add(worker_id)

    @property
    def pending(self) -> bool:
        return bool(self._release or self._stopped or self._removed or self._settle)

    def cancel_requested(self, runs: list[lease.RunRef], now: float) -> set[int] | None:
        """The ids among `runs` (its children's, by id and owner) whose cancel was requested;
        None if the database could not be asked."""
        if not runs or not self.available(now):
            return None
        params = {"ids": [r.id for r in runs], "owners": [r.owner for r in runs]}
        try:
            rows = self._connection().execute(Q["cancel_requested"], params).fetchall()
        except (psycopg.Error, db.DatabaseUnavailable) as exc:
            self._failed("cancel_requested", exc, now)
            return None
        return {int(r[0]) for r in rows}

    def _write_killed(self, conn: psycopg.Connection[Any], worker_id: str, k: Killed) -> None:
        """The outcome of a run whose handler ignored its abort and whose process was killed."""
        ref = lease.RunRef(k.run_id, k.owner)
        outcome = policy.outcome_after_kill(k.reason)
        why = f"its handler did not stop within abort_grace ({self.config.abort_grace:g} s); process killed"
        status: str | None = None
        if outcome == "cancelled":
            ok = lease.finish(conn, ref, "cancelled", error=f"cancelled; {why}")
            status = "cancelled" if ok else None
        elif outcome == "timeout":
            cfg = self.config
            delay = retry_delay(k.attempt, None, cfg.backoff, cfg.backoff_jitter, self._rand)
            status = lease.requeue(
                conn, ref, delay=delay, error=f"timeout; {why}", outcome="timeout"
            )
        elif outcome == "released":
            status = lease.release(conn, ref, f"shutdown; {why}")
        if status is not None:
            log.event(
                "killed_run_recorded",
                run_id=k.run_id,
                worker=worker_id,
                reason=k.reason,
                status=status,
            )

    def flush(self, now: float) -> list[int]:
        """Write what `child_gone` queued. Returns the ids of the runs whose leases were expired
        (each recorded as a crashed attempt), and wakes idle workers to reclaim them at once."""
        if not self.pending or not self.available(now):
            return []
        released: list[int] = []
        try:
            conn = self._connection()
            for worker_id, killed in list(self._settle.items()):
                self._write_killed(conn, worker_id, killed)
                del self._settle[worker_id]
            for worker_id, reason in list(self._release.items()):
                with conn.transaction():
                    ids = lease.expire_worker_leases(conn, worker_id, reason)
                    if ids:
                        conn.execute(Q["wake_workers"])
                released.extend(ids)
                del self._release[worker_id]
                if ids:
                    log.event("leases_released", worker=worker_id, runs=ids, reason=reason)
            for worker_id in list(self._stopped):
                presence.stop_worker(conn, worker_id)
                self._stopped.discard(worker_id)
            for worker_id in list(self._removed):
                presence.remove_worker(conn, worker_id)
                self._removed.discard(worker_id)
        except (psycopg.Error, db.DatabaseUnavailable) as exc:
            self._failed("release", exc, now)
        return released
