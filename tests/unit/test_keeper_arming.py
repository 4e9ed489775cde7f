"""The dead man's switch as a batch's runs start (`Keeper.begin`): a run's timeout arms it only
when it falls before the time armed (arming walks every held run, and every run's default timeout
is an hour: a walk of the batch at each start), and the switch is never armed later than
`kill_at`."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from leasework import Config
from leasework.leases.lease import Claim
from leasework.workers import keeper as keeper_mod
from leasework.workers.keeper import DEADMAN_SLACK, Keeper


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Switch:
    """The kernel timer's stand-in: when it would fire."""

    def __init__(self) -> None:
        self.armed_at: float | None = None

    def arm(self, at: float, now: float | None = None) -> None:
        self.armed_at = at

    def disarm(self) -> None:
        self.armed_at = None

    def close(self) -> None:
        pass


def claim(run_id: int, timeout: float | None) -> Claim:
    return Claim(
        id=run_id, kind="k", key=None, tenant=None, payload={}, result=None, attempts=1,
        max_attempts=3, owner=uuid.uuid4(), lease_seconds=60.0, timeout_seconds=timeout,
        processed_units=0, total_units=None,
    )  # fmt: skip


def keeper_with_switch(clock: Clock) -> tuple[Keeper, Switch]:
    keeper = Keeper(Config(lease=60.0), name="t", clock=clock)
    switch = Switch()
    keeper.deadman = switch  # type: ignore[assignment]
    return keeper, switch


def test_a_batch_with_the_default_timeout_arms_once_not_at_each_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    keeper, switch = keeper_with_switch(clock)
    walks: list[int] = []
    kill_at = Keeper.kill_at

    def counted(self: Keeper, now: float) -> Any:
        walks.append(len(self._held))
        return kill_at(self, now)

    monkeypatch.setattr(keeper_mod.Keeper, "kill_at", counted)
    claims = [claim(i, 3600.0) for i in range(1, 101)]
    keeper.hold_many(claims, sent=clock.t)
    assert walks == [100]
    for c in claims:
        clock.t += 0.001
        with keeper.holding(c):
            # never later than kill_at (the unpatched one: not counted)
            assert switch.armed_at is not None and switch.armed_at <= kill_at(keeper, clock.t)
    assert [n for n in walks if n] == [100], "each start of a run walked the batch"


def test_a_timeout_before_the_lease_runs_out_arms_the_switch_at_its_deadline() -> None:
    clock = Clock()
    keeper, switch = keeper_with_switch(clock)
    keeper.hold_many([claim(1, 5.0), claim(2, 5.0)], sent=clock.t)
    armed = switch.armed_at
    assert armed is not None
    clock.t += 1.0
    held = keeper.holding(claim(1, 5.0))
    assert held.deadline == clock.t + 5.0
    expected = clock.t + 5.0 + keeper.config.abort_grace + DEADMAN_SLACK
    assert expected < armed and switch.armed_at == expected == keeper.kill_at(clock.t)
