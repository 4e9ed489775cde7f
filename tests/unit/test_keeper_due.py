"""`Keeper.due()`, which a batch asks before each of its runs: true once a held run's renewal or
control query is due, and false again once nothing is (it used to stay true for good after the
first runs it was true for were dropped, so every later run of every batch walked every held run
in `tend`)."""

from __future__ import annotations

import uuid

from leasework import Config
from leasework.leases.lease import Claim
from leasework.workers.keeper import Keeper


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def claim(run_id: int) -> Claim:
    return Claim(
        id=run_id, kind="k", key=None, tenant=None, payload={}, result=None, attempts=1,
        max_attempts=3, owner=uuid.uuid4(), lease_seconds=60.0, timeout_seconds=None,
        processed_units=0, total_units=None,
    )  # fmt: skip


def test_due_only_when_a_held_run_is() -> None:
    clock = Clock()
    keeper = Keeper(Config(lease=60.0), name="t", clock=clock)
    first = keeper.hold(claim(1))
    check = min(first.timing.control, first.timing.renew)
    assert not keeper.due(clock.t)
    clock.t += check
    assert keeper.due(clock.t)


def test_not_due_after_the_runs_it_was_due_for_are_dropped() -> None:
    clock = Clock()
    keeper = Keeper(Config(lease=60.0), name="t", clock=clock)
    held = keeper.hold(claim(1))
    clock.t += min(held.timing.control, held.timing.renew) + 1
    assert keeper.due(clock.t)
    keeper.drop(1)  # its outcome written

    keeper.hold(claim(2))  # the next batch's run, claimed just now

    assert not keeper.due(clock.t)


def test_not_due_after_a_tend_that_found_nothing_due() -> None:
    clock = Clock()
    keeper = Keeper(Config(lease=60.0), name="t", clock=clock)
    old = keeper.hold(claim(1))
    clock.t += min(old.timing.control, old.timing.renew) - 0.5
    keeper.hold(claim(2))  # held while run 1 still is: due() follows run 1 first
    clock.t += 1
    assert keeper.due(clock.t)
    keeper.drop(1)

    keeper.tend(clock.t)  # run 2 is not due yet: no query (there is no database here)

    assert not keeper.due(clock.t)
