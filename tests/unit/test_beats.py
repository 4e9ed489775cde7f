"""A child's beats to its parent (supervisor.child.BeatSender) on a real pipe: a busy child sends
a beat per CHANGE_GAP, not one per run, and the parent still hears its last change within that
gap with no further call (the flusher thread); with a board (liveness.Board, shared memory),
every change is there at once and the pipe waits for MIN_BEAT_GAP. The worker here is a stand-in exposing what the
sender reads; there is no database in this exchange."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from leasework.supervisor.child import BeatSender
from leasework.supervisor.liveness import CHANGE_GAP, MIN_BEAT_GAP, Beat, Board, decode
from leasework.supervisor.parent import Forked
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
        claim = SimpleNamespace(id=run_id, lease_seconds=30.0, owner=uuid.UUID(int=run_id), attempts=1)
        self.held = SimpleNamespace(
            claim=claim,
            renewed=time.monotonic(),
            signal=SimpleNamespace(reason=None),
            deadline=None,
            tripped_at=None,
        )


def close(sender: BeatSender | None, r: int, w: int) -> None:
    """Stop the sender's flusher before its pipe's descriptors close: a flusher still running
    could otherwise write into the next test's pipe, made on the same descriptor numbers."""
    if sender is not None:
        with sender._lock:
            sender.orphaned = True
            sender._due.notify()
        if sender._flusher is not None:
            sender._flusher.join(10)
    os.close(r)
    os.close(w)


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


def test_changes_wait_for_the_gap_a_new_run_goes_at_once_and_the_last_arrives_unasked() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    sender = None
    try:
        sender = BeatSender(w, os.getppid(), 0)
        worker = StandIn()
        worker.claim(1)
        sender(worker, None)  # type: ignore[arg-type]
        assert [b.run_id for b in beats(r)] == [1]  # a new run: at once
        changes = 2000
        started = time.monotonic()
        for n in range(1, changes + 1):  # renewals and jobs done of the same run: a burst
            worker.held.renewed = time.monotonic()
            worker.jobs_done = n
            sender(worker, None)  # type: ignore[arg-type]
        elapsed = time.monotonic() - started
        sent = beats(r)
        assert len(sent) <= elapsed / CHANGE_GAP + 2, (len(sent), elapsed)  # not 2,000
        # A new run is sent at once, whatever the gap: the handler may hold the GIL next.
        worker.claim(2)
        sender(worker, None)  # type: ignore[arg-type]
        assert beats(r)[-1].run_id == 2
        # A finish right after it waits for the gap; the flusher sends it with no further call.
        worker.held, worker.jobs_done = None, changes + 1
        sender(worker, None)  # type: ignore[arg-type]
        heard: list[Beat] = []

        def last_change_heard() -> bool:
            heard.extend(beats(r))
            return bool(heard) and heard[-1].run_id is None and heard[-1].jobs == changes + 1

        wait_for(last_change_heard, timeout=10)
    finally:
        close(sender, r, w)


def test_a_run_per_change_does_not_wake_the_flusher_per_run() -> None:
    """A busy child alternates a new run (sent at once) and its finish (held for the gap): the
    flusher, already waiting for the gap's end, is not woken for each finish. A notify per run
    made the flusher take the GIL and the lock per job: four or five futex calls a job, a third of
    a one-at-a-time child's CPU."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    sender = None
    try:
        sender = BeatSender(w, os.getppid(), 0)
        notified = 0
        notify = sender._due.notify

        def counted(n: int = 1) -> None:
            nonlocal notified
            notified += 1
            notify(n)

        sender._due.notify = counted  # type: ignore[method-assign]
        worker = StandIn()
        runs = 1000
        started = time.monotonic()
        for run_id in range(1, runs + 1):
            worker.claim(run_id)
            sender(worker, None)  # type: ignore[arg-type]
            worker.held, worker.jobs_done = None, run_id
            sender(worker, None)  # type: ignore[arg-type]
            beats(r)  # the pipe never fills
        elapsed = time.monotonic() - started
        # At most a wake-up per gap (the flusher found nothing pending at a gap's end and waits
        # without a deadline until the next finish), not one per run.
        assert notified <= 2 * (elapsed / CHANGE_GAP) + 2, (notified, elapsed)
        heard: list[Beat] = []

        def last_finish_heard() -> bool:
            heard.extend(beats(r))
            return bool(heard) and heard[-1].run_id is None and heard[-1].jobs == runs

        wait_for(last_finish_heard, timeout=10)
    finally:
        close(sender, r, w)


def test_a_board_reads_back_what_was_written_and_refuses_a_torn_record() -> None:
    board = Board()
    try:
        assert board.read() is None  # nothing written yet
        owner = uuid.uuid4()
        board.write(
            12.5, 7, 11.0, 30.0, 3, owner=owner.bytes, attempt=2, timeout_at=40.0,
            abort="cancelled", abort_at=12.0, runs=4,
        )  # fmt: skip
        read = board.read()
        assert read is not None
        assert read[1] == Beat(
            t=12.5, run_id=7, renewed=11.0, lease=30.0, jobs=3, owner=owner.hex, attempt=2,
            timeout_at=40.0, abort="cancelled", abort_at=12.0, runs=4,
        )  # fmt: skip
        assert uuid.UUID(read[1].owner or "") == owner  # as the parent's run_ref reads it
        board.write(13.0, None, None, None, 4)
        again = board.read()
        assert again is not None and again[0] == read[0] + 1
        assert again[1] == Beat(t=13.0, run_id=None, renewed=None, lease=None, jobs=4)
        board._mm[9] ^= 0xFF  # a byte of `t` changed under the CRC: a reading torn by a write
        assert board.read() is None
    finally:
        board.close()


def test_with_a_board_a_new_run_is_posted_at_once_and_the_pipe_waits_for_the_gap() -> None:
    """A busy child's new runs reach the board at once and the pipe at most once per
    MIN_BEAT_GAP; the last change still arrives on the pipe unasked."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    sender = None
    board = Board()
    try:
        sender = BeatSender(w, os.getppid(), 0, board)
        worker = StandIn()
        runs = 1000
        started = time.monotonic()
        lines: list[Beat] = []
        for run_id in range(1, runs + 1):
            worker.claim(run_id)
            sender(worker, None)  # type: ignore[arg-type]
            read = board.read()
            assert read is not None and read[1].run_id == run_id  # at once, every one
            assert read[1].owner == uuid.UUID(int=run_id).hex
            worker.held, worker.jobs_done = None, run_id
            sender(worker, None)  # type: ignore[arg-type]
            lines += beats(r)
        elapsed = time.monotonic() - started
        assert len(lines) <= 2 * (elapsed / MIN_BEAT_GAP) + 2, (len(lines), elapsed)  # not 2,000

        def last_finish_heard() -> bool:
            lines.extend(beats(r))
            return bool(lines) and lines[-1].run_id is None and lines[-1].jobs == runs

        wait_for(last_finish_heard, timeout=10)
        # A run that must stop goes out on the pipe at once, gap or not.
        worker.claim(runs + 1)
        sender(worker, None)  # type: ignore[arg-type]
        worker.held.signal.reason = "cancelled"
        sender(worker, None)  # type: ignore[arg-type]
        assert beats(r)[-1].abort == "cancelled"
    finally:
        close(sender, r, w)
        board.close()


def test_the_parent_takes_the_newest_of_the_board_and_the_pipe() -> None:
    """Forked.look: a record written since the last reading is the child's state, and says the
    child was alive then; an older pipe line read after it does not take its place."""
    board = Board()
    try:
        child = Forked(pid=1, worker_id="w", fd=-1, started=0.0, generation=0, slot=None,
                       last_beat=5.0, board=board)  # fmt: skip
        board.write(8.0, 42, 7.5, 30.0, 9, owner=uuid.UUID(int=42).bytes, attempt=1)
        child.look(now=10.0)
        assert child.current_run() == 42 and child.last_beat == 8.0
        ref = child.run_ref()
        assert ref is not None and ref.owner == uuid.UUID(int=42)
        child.heard(Beat(t=7.0, run_id=41, renewed=6.0, lease=30.0, jobs=8))  # the pipe, late
        assert child.current_run() == 42
        child.last_beat = 11.0
        child.look(now=12.0)  # nothing written since: no change, and no life claimed
        assert child.last_beat == 11.0 and child.current_run() == 42
        board.write(30.0, None, None, None, 10)  # a clock ahead of the parent's reading
        child.look(now=20.0)
        assert child.current_run() is None and child.last_beat == 20.0
    finally:
        board.close()
