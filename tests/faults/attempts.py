"""The attempt oracle of the non-cooperative tier: when each attempt of a run was alive, from the
handlers' journal (start and end, with pid and wall-clock time, tests/faults/blockingapp.py) and
from watching the worker processes themselves.

An attempt is alive from its start until its handler left (the journal's end) or, if it never
left, until its process was gone (exited, zombie or killed). Both ends are taken on the safe side,
so an overlap reported is an overlap that happened: the journal's times are read inside the
handler (it had started by its start time and not yet left at its end time), and a process
without an end is counted alive only until the last moment it was seen alive. A stopped
(SIGSTOP) process is alive: continued, it would go on running its handler.

Never sends a signal; reads /proc and the journal only."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

Query = Callable[[str, Any], list[tuple[Any, ...]]]

GONE_STATES = ("Z", "X", "x")
WATCH_EVERY = 0.01  # seconds between two looks at every process


@dataclass
class Attempt:
    run_id: int
    attempt: int
    owner: str
    pid: int
    start: float  # wall clock, read in the handler once it had started
    end: float | None = None  # read in the handler before it left, if it left
    how: str | None = None  # returned, or the exception it left with


def process_start(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None if it is gone or a zombie. With
    the pid it names one process: a pid reused later has another start time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:  # no such pid, or it exited while read (ESRCH)
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    if len(fields) < 20 or fields[0] in GONE_STATES:
        return None
    return int(fields[19])  # field 22 of proc_pid_stat(5); fields[0] is field 3


class AttemptLog:
    """Reads the journal as it grows and watches every worker process (those `pids()` names, and
    every pid in the journal) on a thread of its own, until `close()`."""

    def __init__(self, journal: Path, pids: Callable[[], Iterable[int]]) -> None:
        self.journal = journal
        self._pids = pids
        self._lock = threading.Lock()
        self._offset = 0
        self.attempts: dict[str, Attempt] = {}  # by owner token: one attempt per claim
        self._identity: dict[int, int] = {}  # pid -> its start time, when first seen
        self.last_alive: dict[int, float] = {}  # pid -> last wall-clock time seen alive
        self.gone_at: dict[int, float] = {}  # pid -> first wall-clock time seen gone
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="attempt-log", daemon=True)
        self._thread.start()

    # -- watching -------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closing.is_set():
            self.look()
            self._closing.wait(WATCH_EVERY)

    def look(self) -> None:
        """Read new journal lines, then look at every process not yet gone."""
        with self._lock:
            self._read()
            known = set(self.last_alive) | set(self._identity)
            with contextlib.suppress(OSError):
                known.update(self._pids())
            for pid in known - set(self.gone_at):
                now = time.time()  # before the look: alive at the look means alive at `now`
                start = process_start(pid)
                first = self._identity.setdefault(pid, start) if start is not None else None
                if start is None or start != first:
                    self.gone_at[pid] = time.time()
                else:
                    self.last_alive[pid] = max(self.last_alive.get(pid, now), now)

    def _read(self) -> None:
        try:
            with open(self.journal, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # whole lines only: a line being written is read next time
        self._offset += end
        for line in data[:end].splitlines():
            doc = orjson.loads(line)
            pid, t = int(doc["pid"]), float(doc["t"])
            # It was alive when it wrote the line, whether or not it was ever seen.
            self.last_alive[pid] = max(self.last_alive.get(pid, t), t)
            att = self.attempts.get(doc["owner"])
            if att is None:
                att = self.attempts[doc["owner"]] = Attempt(
                    int(doc["run"]), int(doc["attempt"]), doc["owner"], pid, t
                )
            if doc["event"] == "start":
                att.start = min(att.start, t)
            elif att.end is None or t < att.end:
                att.end, att.how = t, doc.get("how")

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=5)
        self.look()

    # -- reading ----------------------------------------------------------------------------------

    def of_run(self, run_id: int) -> list[Attempt]:
        with self._lock:
            return sorted(
                (a for a in self.attempts.values() if a.run_id == run_id), key=lambda a: a.start
            )

    def running(self, run_id: int, attempt: int | None = None) -> Attempt | None:
        """The run's attempt whose handler has started and not left, its process not gone."""
        self.look()
        with self._lock:
            for a in self.attempts.values():
                if (
                    a.run_id == run_id
                    and (attempt is None or a.attempt == attempt)
                    and a.end is None
                    and a.pid not in self.gone_at
                ):
                    return a
        return None

    def alive_until(self, a: Attempt, now: float) -> float:
        """The latest moment the attempt is known to have been alive."""
        if a.end is not None:
            return a.end
        if a.pid in self.gone_at:
            return self.last_alive.get(a.pid, a.start)
        return now  # its handler has not left and its process is there

    def gone(self, pid: int) -> float | None:
        """When the process was first seen gone, if it is."""
        with self._lock:
            return self.gone_at.get(pid)

    # -- the invariant ----------------------------------------------------------------------------

    def overlaps(self, run_ids: Iterable[int]) -> list[str]:
        """No two attempts of one run alive at once."""
        self.look()
        now = time.time()
        out = []
        for run_id in run_ids:
            attempts = self.of_run(run_id)
            with self._lock:
                for i, a in enumerate(attempts):
                    for b in attempts[i + 1 :]:
                        both_from = max(a.start, b.start)
                        both_until = min(self.alive_until(a, now), self.alive_until(b, now))
                        if both_from < both_until:
                            out.append(
                                f"run {run_id}: attempt {a.attempt} (pid {a.pid}, {a.how or 'no end'})"
                                f" and attempt {b.attempt} (pid {b.pid}, {b.how or 'no end'}) both"
                                f" alive for {both_until - both_from:.3f} s"
                            )
        return out

    def held_by_the_dead(self, query: Query, slack: float) -> list[str]:
        """A run whose attempt's process died is not left `running` under that attempt's token
        for longer than `slack` past the lease the token last had (or past the death, if that
        came later), in the oracle's transition log (oracle.sql). `query`: ChaosRun.query."""
        out = []
        with self._lock:
            dead = [
                (a, self.gone_at[a.pid]) for a in self.attempts.values() if a.pid in self.gone_at
            ]
        for a, gone in dead:
            expires, left = query(
                "SELECT extract(epoch FROM max(new_expires) FILTER (WHERE new_owner = %(t)s)),"
                " extract(epoch FROM min(at) FILTER (WHERE old_owner = %(t)s"
                "  AND new_owner IS DISTINCT FROM %(t)s))"
                " FROM public.chaos_transitions WHERE run_id = %(run)s",
                {"t": uuid.UUID(a.owner), "run": a.run_id},
            )[0]
            since = max(float(expires or 0), gone)
            if left is None:
                out.append(
                    f"run {a.run_id} still running under token {a.owner} of pid {a.pid},"
                    f" gone {time.time() - gone:.1f} s ago"
                )
            elif float(left) > since + slack:
                out.append(
                    f"run {a.run_id} left running under token {a.owner} of dead pid {a.pid}"
                    f" {float(left) - since:.2f} s past its lease"
                )
        return out
