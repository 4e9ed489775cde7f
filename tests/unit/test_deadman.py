"""The dead man's switch: the kernel kills a process stuck in a C call holding the GIL at the
armed time, disarming cancels it; and when the keeper arms it: before any held lease it last
renewed could expire (lost or not), and after a tripped or timed-out handler's grace."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from leasework import Config
from leasework.config import lease_timing
from leasework.leases.lease import Claim
from leasework.workers.deadman import Deadman
from leasework.workers.keeper import DEADMAN_SLACK, Keeper

pytestmark = pytest.mark.skipif(not Deadman().available, reason="no POSIX timers here")

STUCK = textwrap.dedent(
    """
    import sys, time
    from leasework.workers.deadman import Deadman

    d = Deadman()
    d.arm(time.monotonic() + float(sys.argv[1]))
    if sys.argv[2] == "disarm":
        d.disarm()
        time.sleep(1.0)  # past the time it was armed for
        sys.exit(0)
    sum(range(10**10))  # minutes in one C call holding the GIL, deaf to signals
    sys.exit(0)
    """
)


def run(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-c", STUCK, *args], capture_output=True, timeout=60, check=False
    )


def test_the_kernel_kills_a_process_holding_the_gil_at_the_armed_time() -> None:
    assert run("0.3", "stay").returncode == -9


def test_disarming_cancels_the_kill() -> None:
    assert run("0.3", "disarm").returncode == 0


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def claim(run_id: int = 1, lease: float = 60.0, timeout: float | None = None) -> Claim:
    return Claim(
        id=run_id, kind="job", key=None, tenant=None, payload={}, result=None, attempts=1,
        max_attempts=3, owner=uuid.uuid4(), lease_seconds=lease, timeout_seconds=timeout,
        processed_units=0, total_units=None,
    )  # fmt: skip


def test_the_keeper_arms_before_the_lease_and_after_the_grace() -> None:
    clock = Clock()
    cfg = Config(lease=60.0, abort_grace=5.0)  # margin 10 s: armed 5 s before the lease runs out
    keeper = Keeper(cfg, name="t", clock=clock)
    assert keeper.kill_at(clock.t) is None  # nothing held: nothing to kill for
    held = keeper.hold(claim(timeout=30.0))
    assert keeper.kill_at(clock.t) == 1000.0 + 55.0
    keeper.begin(held)
    assert keeper.kill_at(clock.t) == 1000.0 + 30.0 + 5.0 + DEADMAN_SLACK  # timeout + grace
    held.signal.trip("cancelled")
    held.tripped_at = 1010.0
    assert keeper.kill_at(clock.t) == 1010.0 + 5.0 + DEADMAN_SLACK
    held.signal.reason = "lost"  # a lost run's handler never outlives the lease it last renewed
    held.tripped_at, held.deadline = 1052.0, None
    assert keeper.kill_at(clock.t) == 1055.0
    keeper.drop(held.claim.id)
    assert keeper.kill_at(clock.t) is None


class CountingDeadman(Deadman):
    """A real switch that counts its timer settings."""

    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def _set(self, seconds: float) -> None:
        self.sets += 1
        super()._set(seconds)


def test_back_to_back_runs_rearm_the_switch_rarely_never_later_than_needed() -> None:
    """One-at-a-time mode holds and drops a run every millisecond: the switch is set about once
    per 5 % of the lease's time left, not twice per run, and never later than kill_at."""
    clock = Clock()
    cfg = Config(lease=60.0)
    deadman = CountingDeadman()
    keeper = Keeper(cfg, name="t", clock=clock, deadman=deadman)
    keeper.start()  # its thread disarms an idle switch: drops need not
    started = time.monotonic()
    try:
        runs = 2000
        for run_id in range(1, runs + 1):
            keeper.hold(claim(run_id))
            at = keeper.kill_at(clock.t)
            assert deadman.armed_at is not None and at is not None
            assert at - min(0.05 * (at - clock.t), lease_timing(cfg).margin / 4) <= deadman.armed_at <= at
            keeper.drop(run_id)
            clock.t += 0.001
        # 2 s of runs, a re-arm each 0.05 x 55 s: a few settings, not 4,000; and a disarm and
        # re-arm for each tick of the thread that found the keeper idle between two runs.
        ticks = (time.monotonic() - started) / min(cfg.heartbeat_interval, lease_timing(cfg).control)
        assert deadman.sets <= 2.0 / (0.05 * 55.0) + 2 + 2 * (ticks + 1), deadman.sets
    finally:
        keeper.close()
        deadman.close()


def test_an_idle_keeper_disarms_the_switch_its_last_run_left_armed() -> None:
    """With the keeper's thread running, dropping the last run leaves a far arming in place (the
    next claim re-arms it); the thread disarms it at its next wake if nothing was claimed."""
    cfg = Config(lease=60.0, heartbeat_interval=0.2)
    deadman = CountingDeadman()
    keeper = Keeper(cfg, name="t", deadman=deadman)
    keeper.start()
    try:
        keeper.hold(claim(1))
        keeper.drop(1)
        deadline = time.monotonic() + 30
        while deadman.armed_at is not None:  # waiting on a condition, with a deadline
            assert time.monotonic() < deadline, "the idle keeper never disarmed the switch"
            time.sleep(0.01)
    finally:
        keeper.close()
        deadman.close()
