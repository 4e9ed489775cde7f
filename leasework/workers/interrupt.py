"""Interrupting a sync handler: the keeper's thread sends INTERRUPT_SIGNAL to the main thread,
where Python runs signal handlers, and the worker's handler raises `Aborted` into the run
(Context.interrupt). A worker built on another thread is never interrupted: its handlers see the
abort at their next ctx.check()."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any

# Sent by the keeper's thread to the main thread to interrupt a handler whose run must stop.
INTERRUPT_SIGNAL = signal.SIGUSR2


class MainThread:
    """The main thread's INTERRUPT_SIGNAL handler, installed while a worker is open."""

    def __init__(self) -> None:
        self.ident: int | None = None
        self._old_handler: Any = None

    def install(self, interrupt_now: Callable[[], None]) -> None:
        """Run `interrupt_now` on INTERRUPT_SIGNAL; only from the main thread, once."""
        if self.ident is not None or threading.current_thread() is not threading.main_thread():
            return
        self._old_handler = signal.signal(INTERRUPT_SIGNAL, lambda signum, frame: interrupt_now())
        self.ident = threading.get_ident()

    def send(self) -> None:
        """From another thread (the keeper's): interrupt the main thread, if installed."""
        ident = self.ident
        if ident is not None and threading.get_ident() != ident:
            with suppress(ProcessLookupError, OSError):
                signal.pthread_kill(ident, INTERRUPT_SIGNAL)

    def restore(self) -> None:
        """Put the previous handler back (from the main thread that installed it)."""
        if self.ident is not None and threading.get_ident() == self.ident:
            signal.signal(INTERRUPT_SIGNAL, self._old_handler or signal.SIG_DFL)
            self.ident = None
