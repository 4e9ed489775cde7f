"""The `runs` stage: settle expired and waiting runs, then claim and execute up to `limit` runs
of the app's task kinds, one at a time, inline."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..workers import lease

if TYPE_CHECKING:
    from ..app import App
    from ..workers.worker import Worker


class RunsStage:
    name = "runs"

    def __init__(self, app: App, *, limit: int = 10, settle_limit: int = 100) -> None:
        self.app = app
        self.limit = limit
        self.settle_limit = settle_limit

    def step(self, worker: Worker) -> int:
        kinds = self.app.kinds(stage=self.name)
        # Settle and claim on the control connection: idle between runs, it spares a pool
        # check-out per claim and keeps the claim's generic plan (worker.control_conn).
        ended, promoted = lease.settle_runs(worker.control_conn(), self.settle_limit)
        handled = ended + promoted
        for _ in range(self.limit):
            if worker.stopping:
                break
            claims = lease.claim_runs(
                worker.control_conn(), kinds, worker=worker.id, lease=worker.config.lease, limit=1
            )
            if not claims:
                break
            for claim in claims:
                worker.execute(claim, self.app.handler(claim.kind))
                handled += 1
        return handled
