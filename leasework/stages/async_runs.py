"""The `async` stage: the kinds whose handlers are `async def`. Each step seals the successes that
ended since the last (one statement), then claims up to the free slots of the worker's event loop
in one more and starts a task per run (workers/aexecutor.py). A worker holds at most
`concurrency` of them at once (the config's, else the largest of its async kinds'), and at most a
kind's own `concurrency=` of that kind. The runs go on between steps, while the worker's loop
waits for the next thing to do; expired and waiting runs are settled by the `runs` stage."""

from __future__ import annotations

import time

from ..config import Config
from ..leases import lease
from ..tasks import DEFAULT_CONCURRENCY, Registry
from ..workers import idle
from ..workers.stage import Site
from .runs import declare_limits


class AsyncRunsStage:
    name = "async"
    # Whether the worker must run an event loop for this stage (Worker.asynchronous).
    asynchronous = True

    def __init__(self, app: Registry, config: Config) -> None:
        self.app = app
        self.config = config
        self.limit = self.slots(app.kinds(stage=self.name))
        self._due: idle.Seen = None  # when a run of its kinds is next due, as last read
        self._declared = False  # its kinds' limits written (runs.declare_limits)

    @property
    def wakes(self) -> list[str]:
        """An enqueue NOTIFYs its kind: the kinds this stage runs."""
        return self.app.kinds(stage=self.name)

    def slots(self, kinds: list[str], pool: str | None = None) -> int:
        """How many async runs a worker serving `kinds` holds at once."""
        if pool is not None:
            own = self.config.pool(pool).concurrency
            if own is not None:
                return own
        if self.config.concurrency is not None:
            return self.config.concurrency
        caps = [self.app.tasks[k].concurrency for k in kinds]
        return max(caps, default=DEFAULT_CONCURRENCY)

    def step(self, site: Site) -> int:
        ax = site.aexecutor
        assert ax is not None, "the async stage needs a worker with an async executor"
        handled = ax.seal()
        ax.claim_more = False
        kinds = site.claimable(self.app.kinds(stage=self.name))
        if not self._declared:
            declare_limits(site, self.app, self.name)
            self._declared = True
        if kinds and not site.stopping:
            free = self.slots(kinds, site.pool) - ax.in_flight()
            room = {k: self.app.tasks[k].concurrency - ax.in_flight(k) for k in kinds}
            room = {k: n for k, n in room.items() if n > 0}
            if free > 0 and room:
                # One statement for every free slot; never more of a kind than its own cap.
                limit = min(free, *room.values())
                claims = lease.claim_runs(
                    site.conns.main(),
                    sorted(room),
                    worker=site.worker_id,
                    lease=site.config.lease,
                    limit=limit,
                )
                ax.start(claims, self.app.handler)
                handled += len(claims)
                ax.claim_more = len(claims) == limit
                self._due = None  # read anew when it next runs dry
                if not claims and not ax.in_flight():
                    # Dry and idle: when is a run of its kinds next due (a delayed or retried
                    # run, a lease running out)? An idle worker sleeps until then (`next_due`).
                    due = lease.next_due(site.conns.main(), kinds)
                    self._due = due, time.monotonic()
        if not ax.serving:
            # Polled outside the worker's loop (a test, a benchmark's poll()): the runs end here.
            ax.run_pending()
            handled += ax.seal()
        return handled

    def next_due(self, site: Site) -> float | None:
        """Seconds until a run of its kinds is next due, as the last dry step read it; 0
        (unknown) if it did not (workers/stage.py, Due). A run ending wakes the worker anyway."""
        return idle.due_now(self._due, time.monotonic())
