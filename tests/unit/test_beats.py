"""A child's beats to its parent (supervisor.child.BeatSender) on a real pipe: a busy child sends
a beat per CHANGE_GAP, not one per run, and the parent still hears its last change within that
gap with no further call (the flusher thread). The worker here is a stand-in exposing what the
sender reads; there is no database in this exchange."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from leasework.supervisor.child import BeatSender
from leasework.supervisor.liveness import CHANGE_GAP, Beat, decode
from tests.conftest import wait_for


@dataclass
class StandIn:
    """What BeatSender reads of a Worker: its keeper's most urgent run, jobs done, its state."""

    jobs_done: int = 0
    running: bool = True
    stopping: bool = False
    id: str = "w-1"
    held: Any = None
    keeper: Any = field(default=None)

    def __post_init__(self) -> None:
        self.keeper = SimpleNamespace(most_urgent=lambda: (self.held, 0 if self.held is None else 1))

    def claim(self, run_id: int) -> None:
        claim = SimpleNamespace(id=run_id, lease_seconds=30.0, owner="o", attempts=1)
        self.held = SimpleNamespace(
            claim=claim,
            renewed=time.monotonic(),
            signal=SimpleNamespace(reason=None),
            deadline=None,
            tripped_at=None,
        )


def beats(fd: int) -> list[Beat]:
    out: list[Beat] = []
    try:
        data = os.read(fd, 1 << 20)
    except BlockingIOError:
        return out
    for line in data.splitlines():
        msg = decode(line)
        assert isinstance(msg, Beat)
        out.append(msg)
    return out


def test_a_busy_child_sends_a_beat_per_gap_and_its_last_change_arrives_unasked() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    try:
        sender = BeatSender(w, os.getppid(), 0)
        worker = StandIn()
        runs = 2000
        started = time.monotonic()
        for run_id in range(1, runs + 1):  # a burst of runs, each a change (claim, finish)
            worker.claim(run_id)
            sender(worker, None)  # type: ignore[arg-type]
            worker.held, worker.jobs_done = None, run_id
            sender(worker, None)  # type: ignore[arg-type]
        worker.claim(runs + 1)  # the last change: a run claimed, and no further call
        sender(worker, None)  # type: ignore[arg-type]
        elapsed = time.monotonic() - started
        sent = beats(r)
        # At once for the first change, then one per gap at most: not 4,001.
        assert 1 <= len(sent) <= elapsed / CHANGE_GAP + 2, (len(sent), elapsed)
        heard: list[Beat] = []

        def last_change_heard() -> bool:
            heard.extend(beats(r))
            return bool(heard) and heard[-1].run_id == runs + 1

        wait_for(last_change_heard, timeout=10)  # the flusher sent it at the gap's end
        assert heard[-1].jobs == runs
    finally:
        os.close(r)
        os.close(w)
