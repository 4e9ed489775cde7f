"""A worker's loop on an asyncio event loop, for a worker with an async stage (`async def`
handlers): the same polls as the plain loop (workers/worker.py), its waits awaited, so that the
async runs in flight go on between polls (workers/aexecutor.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from .. import log
from .aexecutor import AsyncExecutor
from .connections import Connections
from .context import describe_error
from .poller import Poller


class Polling(Protocol):
    """What the loop needs of its worker."""

    running: bool
    poller: Poller
    conns: Connections
    aexecutor: AsyncExecutor

    @property
    def stopping(self) -> bool: ...

    def poll_safely(self, skip_idle: bool) -> int: ...

    def drain(self) -> None: ...


class AsyncLoop:
    def __init__(self, worker: Polling) -> None:
        self.worker = worker

    async def run(self, once: bool) -> None:
        """`Worker.run()`'s loop on the event loop. It waits for a NOTIFY, a run ending or the
        poll interval; it polls again at once while the async stage has successes to seal or may
        claim more. Stopping, it claims nothing more and returns once every run in flight has
        ended (finished, or released at the graceful deadline) and been sealed."""
        worker, ax, poller = self.worker, self.worker.aexecutor, self.worker.poller
        skip_idle = False
        while worker.running or ax.in_flight() or ax.done:
            found = worker.poll_safely(skip_idle) if worker.running else self._seal_safely()
            if once and not worker.stopping:
                worker.drain()  # one poll's claims, then its runs to their end
            skip_idle = found > 0
            asynchronous = {s.name for s in poller.stages if getattr(s, "asynchronous", False)}
            others = sum(n for name, n in poller.handled.items() if name not in asynchronous)
            if ax.ready() or (others and worker.running):
                # More to do at once: successes to seal, room after a full claim, or a sync
                # stage that found work (as the plain loop, it polls again without waiting). The
                # runs just started take their first step meanwhile.
                await asyncio.sleep(0)
                woken = worker.conns.wake.take_woken()
            else:
                ax.changed.clear()
                wait = poller.idle_timeout(time.monotonic())
                woken = await worker.conns.wake.idle_wait_async(wait, ax.changed)
                if ax.changed.is_set():  # a run ended: its stage seals it (and claims anew)
                    poller.wake_asynchronous()
                    skip_idle = True
            skip_idle = poller.wake(woken) or skip_idle

    def _seal_safely(self) -> int:
        try:
            return self.worker.aexecutor.seal()
        except Exception as exc:
            log.event("seal_failed", level=40, error=describe_error(exc, 3))
            return 0
