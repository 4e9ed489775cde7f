"""The dead man's switch: a kernel timer that SIGKILLs this process at a deadline unless it is
pushed back in time. The last line of defence when nothing in the process can run any more (a C
call holding the GIL, a handler that ignores every interruption) and no parent is watching, or
the parent is stopped: the process dies before a lease it can no longer confirm expires.

A POSIX timer (timer_create on CLOCK_MONOTONIC with SIGEV_SIGNAL = SIGKILL): the kernel delivers
the signal itself, so neither the GIL nor a Python signal handler can delay it, and no signal
disposition of the user's code can change it. Not inherited across fork(). Linux (glibc) only;
elsewhere `available` is False and the worker says so at start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import signal
import sys
import threading
import time

_CLOCK_MONOTONIC = 1
_SIGEV_SIGNAL = 0


class _SigEvent(ctypes.Structure):
    # struct sigevent on Linux: a union sigval, the signal number, the notification kind, and
    # padding up to 64 bytes.
    _fields_ = [
        ("sigev_value", ctypes.c_void_p),
        ("sigev_signo", ctypes.c_int),
        ("sigev_notify", ctypes.c_int),
        ("_pad", ctypes.c_int * 12),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _ITimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class Deadman:
    """`arm(at)` makes the kernel kill this process at monotonic time `at`; `disarm()` cancels.
    Thread-safe. Create it in the process it guards (after any fork)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._timer = ctypes.c_void_p()
        self._libc: ctypes.CDLL | None = None
        self.armed_at: float | None = None
        if not sys.platform.startswith("linux"):
            return
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            event = _SigEvent(None, int(signal.SIGKILL), _SIGEV_SIGNAL)
            if libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(self._timer)):
                return
        except (OSError, AttributeError):
            return
        self._libc = libc

    @property
    def available(self) -> bool:
        return self._libc is not None

    def arm(self, at: float, now: float | None = None) -> None:
        """Kill this process at monotonic time `at` (replacing any earlier arming)."""
        now = time.monotonic() if now is None else now
        self._set(max(at - now, 0.001))
        self.armed_at = at

    def disarm(self) -> None:
        self._set(0.0)
        self.armed_at = None

    def _set(self, seconds: float) -> None:
        if self._libc is None:
            return
        frac, whole = math.modf(seconds)
        spec = _ITimerspec(_Timespec(0, 0), _Timespec(int(whole), int(frac * 1e9)))
        with self._lock:
            self._libc.timer_settime(self._timer, 0, ctypes.byref(spec), None)

    def close(self) -> None:
        if self._libc is not None:
            self.disarm()
            with self._lock:
                self._libc.timer_delete(self._timer)
            self._libc = None
