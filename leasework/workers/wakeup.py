"""How an idle worker is woken: LISTEN (on the worker's main connection; behind a pooler, on a
direct connection to `listen_dsn`, or the parent's relay through the wake pipe), the NOTIFYs
drained into `woken`, and the idle wait (`idle_wait`, and `idle_wait_async` on the worker's event
loop). Sends nothing but LISTEN; never runs job code.

Behind a pooler with `listen_dsn` under no supervisor, one more connection per worker process:
the one LISTEN runs on (connections.py counts the others)."""

from __future__ import annotations

import asyncio
import os
import select
import time
from collections.abc import Callable
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Protocol

import psycopg

from .. import db, log

if TYPE_CHECKING:
    from ..config import Config

Conn = psycopg.Connection[Any]
# The longest piece of an idle wait between two looks at whether the worker must stop.
WAIT_PIECE = 1.0


class Conns(Protocol):
    """What the wake-up needs of the worker's connections (connections.py, `Connections`)."""

    config: Config
    name: str

    def main(self) -> Conn: ...

    def current(self) -> Conn | None: ...

    def drop_main(self) -> None: ...

    @property
    def behind_pooler(self) -> bool: ...


class Wakeup:
    def __init__(self, conns: Conns, wanted: Callable[[str], bool]) -> None:
        self._conns = conns
        # Which NOTIFY payloads are worth remembering (those a stage of this worker serves).
        self._wanted = wanted
        # Behind a pooler: the direct connection LISTEN runs on (listen_dsn), if any.
        self._listener: Conn | None = None
        self._listen_refused = False  # listen_dsn turned out to be pooled too: poll instead
        # Under the supervisor with listen_dsn: the read end of the pipe where the parent relays
        # the NOTIFYs it hears on the host's one direct connection (supervisor/wakeup.py); used
        # instead of a connection of our own when behind a pooler.
        self.relay_fd: int | None = None
        # The connection LISTEN was issued on: the listener, or the main connection as it was
        # then (one reopened since, or dropped, listens no more).
        self._listened: Conn | None = None
        self._wake_failed = False  # the last _wake_fd could not reach the database
        # Payloads of the NOTIFYs received since the run loop last looked (a task kind, or
        # `upload`): at most one entry per payload, however many enqueues sent them.
        self.woken: set[str] = set()
        # A NOTIFY naming nothing this worker serves (the supervisor's fast release sends
        # `reclaim`) ended the last idle wait: the worker then asks every stage.
        self.stray = False

    @property
    def _listening(self) -> bool:
        """Whether LISTEN holds on the connection NOTIFYs arrive on now."""
        heard = self._listener if self._listener is not None else self._conns.current()
        return heard is not None and heard is self._listened

    def close(self) -> None:
        self._drop_listener()

    def _note(self, payload: str) -> None:
        """Remember a payload this worker serves. Any NOTIFY still ends an idle wait (the
        supervisor's fast release sends one without a kind): another is `stray`."""
        if self._wanted(payload):
            self.woken.add(payload)
        else:
            self.stray = True

    @property
    def can_wake(self) -> bool:
        """Whether a NOTIFY can end this worker's idle wait: LISTEN on a direct main connection;
        behind a pooler, the parent's relay or a direct `listen_dsn`. False while the main
        connection is down (nothing is heard then either)."""
        if self.relay_fd is not None:
            return True
        conn = self._conns.current()
        if conn is None or conn.closed or conn.broken:
            return False
        if not db.is_pooled(conn):
            return True
        return bool(self._conns.config.listen_dsn) and not self._listen_refused

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
            listener = self._conns.behind_pooler
            return self._listen_on(self._listen_connection() if listener else self._conns.main())
        except (psycopg.Error, db.DatabaseUnavailable) as exc:
            log.event("listen_failed", level=30, error=log.first_line(exc))
            if listener:
                self._drop_listener()
            else:
                self._conns.drop_main()
            return False

    def _listen_on(self, conn: Conn | None) -> bool:
        """LISTEN on `conn` unless listening already; whether it did (then anything committed
        before went unheard: the caller polls before it waits)."""
        if conn is not None and not self._listening:
            conn.execute(f"LISTEN {db.NOTIFY_CHANNEL}")
            self._listened = conn
            return True
        return False

    def drain_notifies(self) -> None:
        """Move the NOTIFYs psycopg kept while the main connection was busy (it holds every one
        it reads during a claim or a checkpoint) into `woken`. Called after each poll and each
        checkpoint: a busy worker under a steady stream of enqueues would otherwise hold one
        object per enqueue until it next slept, and then wake once for each."""
        if self.relay_fd is not None:
            self._read_relay()
        listener = self._listener is not None
        conn = self._listener if listener else self._conns.current()
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
                self._conns.drop_main()

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
        piece = min(self._conns.config.poll_interval, WAIT_PIECE)
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
            listener = self._conns.behind_pooler
            if listener and self.relay_fd is not None:
                self._wait_for_relay(seconds)
                return True
            conn = self._listen_connection() if listener else self._conns.main()
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
                self._conns.drop_main()
            time.sleep(min(seconds, 1.0))
            return False

    async def idle_wait_async(self, seconds: float, also: asyncio.Event) -> set[str]:
        """`idle_wait` on the worker's event loop (async handlers): the loop watches the socket
        a NOTIFY arrives on (the main connection, `listen_dsn`'s, or the parent's relay pipe)
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
            listener = self._conns.behind_pooler
            if listener and self.relay_fd is not None:
                return self.relay_fd
            conn = self._listen_connection() if listener else self._conns.main()
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
                self._conns.drop_main()
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
        config = self._conns.config
        if not config.listen_dsn or self._listen_refused:
            return None
        conn = self._listener
        if conn is None or conn.closed or conn.broken:
            self._drop_listener()
            conn = db.connect_listener(
                config.listen_dsn,
                application_name=f"leasework:{self._conns.name}:listen",
                instead="idle workers poll instead",
            )
            if conn is None:
                self._listen_refused = True
                return None
            self._listener = conn
        return conn

    def _drop_listener(self) -> None:
        if self._listener is not None:
            with suppress(Exception):
                self._listener.close()
            self._listener = None
            self._listened = None
