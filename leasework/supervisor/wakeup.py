"""The host's wake-up relay, for children behind a pooler in transaction mode (where a LISTEN
cannot be kept): the parent LISTENs on one direct connection to `listen_dsn` and passes each
NOTIFY's payload to every child through the child's wake pipe, so a host costs one direct
connection for wake-up instead of one per child.

The connection is opened lazily, read only when select() says it is readable, and closed before
every fork (a child must never share its socket). NOTIFYs sent while it is closed are lost: so
each time it opens again every child is woken (an empty line) and polls every stage once, which
sees whatever those NOTIFYs were for (an idle child may otherwise sleep `idle_poll_max`). A write to a full pipe is dropped (that child
has not read its earlier wake-ups yet; it will poll). Never raises into the parent's loop."""

from __future__ import annotations

import contextlib
import os
import select
from typing import Any

import psycopg

from .. import db, log
from ..config import Config

# After a failed connect, wait this long before trying again: the parent's loop pays at most one
# connect timeout per interval while the database is away.
RETRY_AFTER = 5.0
# Payloads longer than this are not relayed (a task kind is a short name); a child woken by
# another payload, or none, still polls every stage it would have.
MAX_PAYLOAD = 512
# What wakes every child after the relay (re)opened: a payload naming no stage, so each child
# polls every stage (workers/wakeup.py, `stray`).
WAKE_ALL = b"\n"


class Relay:
    def __init__(self, config: Config, *, behind_pooler: bool = False) -> None:
        """Wanted when the children's `dsn` goes through a pooler and `listen_dsn` is set (direct,
        each child LISTENs on its own main connection)."""
        self.config = config
        self.enabled = bool(config.listen_dsn) and behind_pooler
        self._conn: psycopg.Connection[Any] | None = None
        self._retry_at = float("-inf")
        self._refused = False

    def fileno(self) -> int | None:
        """The connection's socket while it is open, for the parent's select()."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            return None
        return conn.fileno()

    def ensure(self, now: float) -> bool:
        """Open the connection and LISTEN if it is wanted and not open (at most once every
        RETRY_AFTER after a failure). True when it has just done so: the children must then be
        woken (`WAKE_ALL`), as NOTIFYs may have been lost while it was closed."""
        if not self.enabled or self._refused or now < self._retry_at:
            return False
        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            return False
        self.close()
        try:
            conn = db.connect_listener(
                self.config.listen_dsn,
                application_name="leasework:supervisor:listen",
                instead="the children poll instead",
                **db.HANG_GUARD,
            )
        except (db.DatabaseUnavailable, psycopg.Error) as exc:
            self._failed(exc, now)
            return False
        except Exception as exc:  # a refusal (ConfigError): say so, and stop trying
            log.event("listen_failed", level=40, error=log.first_line(exc))
            self._refused = True
            return False
        if conn is None:
            self._refused = True
            return False
        try:
            conn.execute(f"LISTEN {db.NOTIFY_CHANNEL}")
        except psycopg.Error as exc:
            conn.close()
            self._failed(exc, now)
            return False
        self._conn = conn
        return True

    def read(self, now: float) -> bytes:
        """The payloads received since the last call, one per line (each once), or b""."""
        conn = self._conn
        if conn is None:
            return b""
        payloads: set[str] = set()
        try:
            for note in conn.notifies(timeout=0):
                if len(note.payload) <= MAX_PAYLOAD and "\n" not in note.payload:
                    payloads.add(note.payload)
                else:
                    payloads.add("")
        except psycopg.Error as exc:
            self._failed(exc, now)
        return b"".join(p.encode() + b"\n" for p in sorted(payloads))

    def _failed(self, exc: BaseException, now: float) -> None:
        log.event("listen_failed", level=30, error=log.first_line(exc))
        self.close()
        self._retry_at = now + RETRY_AFTER

    def close(self) -> None:
        """Close the connection (before every fork)."""
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None


def send(fd: int, data: bytes) -> None:
    """Write `data` (whole lines) to a child's wake pipe without blocking, in pieces of at most
    PIPE_BUF bytes, which a pipe takes whole or not at all: the child never reads half a line.
    What does not fit is dropped (the pipe is full, or the child is gone)."""
    lines = data.splitlines(keepends=True)
    while lines:
        piece = lines.pop(0)
        while lines and len(piece) + len(lines[0]) <= select.PIPE_BUF:
            piece += lines.pop(0)
        try:
            os.write(fd, piece)
        except OSError:  # BlockingIOError: full; BrokenPipeError: gone
            return
