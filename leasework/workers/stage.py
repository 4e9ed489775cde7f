"""What a stage is, and the narrow part of its worker a stage may use (`Site`): the connections,
the executor, the worker's id and settings, and whether it is stopping. Stages live above this
package (leasework/stages/ and the families); this package imports none of them."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

from ..config import Config
from .aexecutor import AsyncExecutor
from .connections import Connections
from .executor import Executor


@dataclass(frozen=True)
class Site:
    """Handed to `Stage.step`: everything a stage may touch of the worker running it."""

    worker_id: str
    config: Config
    conns: Connections
    executor: Executor
    is_stopping: Callable[[], bool]
    # Whether a stage other than the one named is due for its turn (it found work last time, or
    # its idle period has passed, or a NOTIFY asked for it). Default: always, so a stage ends its
    # step at its limit.
    others_due: Callable[[str], bool] = lambda name: True
    # The worker's pool (config `pools`): whether it claims a kind. Every kind without a pool.
    serves: Callable[[str], bool] = lambda kind: True
    # Where async handlers run (several at once on the worker's event loop); None in a Site built
    # without one (a stage that runs no async handler never needs it).
    aexecutor: AsyncExecutor | None = None
    # The worker's pool (config `pools`), None without one.
    pool: str | None = None

    @property
    def stopping(self) -> bool:
        """The worker is stopping: claim nothing more (a claim in hand still runs)."""
        return self.is_stopping()

    def yield_after_limit(self, name: str) -> bool:
        """Asked by a stage that has done its `limit` and has more: should it end its step now?
        Yes if another stage is due; if every other stage is resting (it found nothing a moment
        ago), the stage may go on, so a busy queue is not cut into polls for nothing."""
        return self.others_due(name)

    def claimable(self, kinds: Iterable[str]) -> list[str]:
        """The kinds among `kinds` this worker claims: a stage passes its kinds through this
        before every claim (claim_runs, finish_and_claim, a batch's), so a child of a pool never
        takes another pool's runs."""
        return [k for k in kinds if self.serves(k)]


class Stage(Protocol):
    """One bounded step of a poll. `wakes`: the NOTIFY payloads (task kinds, `upload`) whose
    arrival asks this stage at once rather than at its next turn. A stage with settings of its
    own declares them beside it as a config section (`config.section`) and names it in a
    `settings` class attribute; its `limit` usually comes from there."""

    name: str
    limit: int

    @property
    def wakes(self) -> Collection[str]: ...

    def step(self, site: Site) -> int:
        """Do at most `limit` items of work; return how many were handled."""
        ...


class Due(Protocol):
    """What a stage may also have (optional): `next_due(site)`, asked by the worker after a step
    that handled nothing, says in how many seconds the stage has work again by what that step saw
    (a delayed run, a lease running out, a schedule); None when nothing will be due until a NOTIFY
    naming it; 0 when it cannot tell. The idle worker sleeps until then, at most `idle_poll_max`
    (workers/idle.py). A stage without it is asked every `poll_interval`, as before. It should
    be cheap: read in the step's own transaction, not by a query of its own per call. A stage
    whose work only it makes due (maintenance: durable periods) sets `exact_due = True` and
    rests until then even past `idle_poll_max`, the cap that covers what a worker cannot see
    coming (a NOTIFY lost while reconnecting, a column moved by hand)."""

    def next_due(self, site: Site) -> float | None: ...
