"""One poll of a worker's stages: each once, in a fixed order, each bounded and wrapped in its own
try/except; which stages rest until they are next due (workers/idle.py), and which a NOTIFY asks
for at once. Knows no stage: the worker hands it the list."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol

from .. import log
from ..config import Config
from ..errors import gave_up_on_lock, is_transient
from . import idle
from .context import describe_error
from .stage import Site, Stage


class Polled(Protocol):
    """What a poller reads of its worker, when it needs it (a test may replace its settings or
    its stage list)."""

    config: Config
    stages: list[Stage]
    site: Site

    @property
    def stopping(self) -> bool: ...

    def serves(self, kind: str) -> bool: ...


class Poller:
    def __init__(self, worker: Polled) -> None:
        self.worker = worker
        self.handled: dict[str, int] = {}  # stage name -> what it handled in the last poll
        self.idle_until: dict[str, float] = {}  # stage name -> monotonic time to ask it again
        # Stages whose last step gave up on a lock another session holds: logged at warning once,
        # then at debug while it lasts (it is tried again every poll).
        self._held_back: set[str] = set()

    @property
    def stages(self) -> list[Stage]:
        return self.worker.stages

    def poll(self, *, skip_idle: bool, wakes: bool) -> int:
        """Run every stage once, in order; how many items they handled. skip_idle: a stage that
        found nothing rests until it is next due (`wakes`: a NOTIFY can end its rest early)."""
        site = self.worker.site
        done = 0
        now = time.monotonic()
        for stage in self.stages:
            if self.worker.stopping:
                break
            if skip_idle and now < self.idle_until.get(stage.name, 0.0):
                continue
            handled = 0
            due: float | None = 0.0  # unknown, unless the stage can tell
            try:
                handled = stage.step(site)
                if not handled:
                    due = self.next_due(stage)
            except Exception as exc:  # one failing stage never skips the ones after it
                if gave_up_on_lock(exc):
                    again = stage.name in self._held_back
                    self._held_back.add(stage.name)
                    log.event(
                        "lock_unavailable",
                        level=10 if again else 30,
                        stage=stage.name,
                        error=log.first_line(exc),
                    )
                else:
                    level = 30 if is_transient(exc) else 40
                    log.event(
                        "stage_failed", level=level, stage=stage.name, error=describe_error(exc, 3)
                    )
            else:
                self._held_back.discard(stage.name)
            done += handled
            self.handled[stage.name] = handled
            if handled:
                self.idle_until.pop(stage.name, None)
            else:
                cfg = self.worker.config
                exact = bool(getattr(stage, "exact_due", False))
                rest = idle.rest(
                    due, cfg.poll_interval, cfg.idle_poll_max, wakes=wakes, exact=exact
                )
                self.idle_until[stage.name] = time.monotonic() + rest
        return done

    def next_due(self, stage: Stage) -> float | None:
        """The stage's own answer (`Due.next_due`), or 0 (unknown: poll_interval) without one."""
        ask: Callable[[Site], float | None] | None = getattr(stage, "next_due", None)
        return 0.0 if ask is None else ask(self.worker.site)

    def idle_timeout(self, now: float) -> float:
        """How long an idle wait may last: until the first stage's rest ends, each resting until
        it is next due, at most idle_poll_max (workers/idle.py)."""
        rests = [self.idle_until.get(s.name, now) for s in self.stages]
        return idle.timeout(now, rests, self.worker.config.poll_interval)

    def others_due(self, name: str, woken: Iterable[str]) -> bool:
        """Is a stage other than `name` due: not resting, or asked for by a NOTIFY (`woken`)?"""
        now, rest = time.monotonic(), self.idle_until
        due = any(s.name != name and now >= rest.get(s.name, 0.0) for s in self.stages)
        return due or any(self.stage_for(p) not in (None, name) for p in woken)

    def wake(self, woken: set[str]) -> bool:
        """Woken by a NOTIFY naming a kind: ask its stage at once and leave the stages polled a
        moment ago for their next turn (pickup latency, bench/README.md). Whether any was."""
        asked = False
        for stage in {self.stage_for(p) for p in woken}:
            if stage is not None:
                self.idle_until.pop(stage, None)
                asked = True
        return asked

    def wake_asynchronous(self) -> None:
        """A run of the async stage ended: ask it at once (it seals, and claims anew)."""
        for stage in self.stages:
            if getattr(stage, "asynchronous", False):
                self.idle_until.pop(stage.name, None)

    def stage_for(self, payload: str | None) -> str | None:
        """The stage a NOTIFY's payload wakes (a task kind, `upload`, or one of leasework's own
        under `leasework:`, which every pool's workers take: `leasework:deps`); None if none
        does, or if it names a kind this worker's pool does not claim."""
        if payload is None:
            return None
        if not payload.startswith("leasework:") and not self.worker.serves(payload):
            return None
        for stage in self.stages:
            if payload in stage.wakes:
                return stage.name
        return None

    @property
    def asynchronous(self) -> bool:
        """Whether a stage runs async handlers of kinds this worker claims."""
        return any(
            getattr(stage, "asynchronous", False) and any(map(self.worker.serves, stage.wakes))
            for stage in self.stages
        )
