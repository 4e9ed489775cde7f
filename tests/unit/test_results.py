"""The wait's core (results._waiting), driven without a database: what it asks for, on a clock
of its own. Through a pooler it polls at 50 ms growing by half to 1 s; on a direct connection it
reads the run once when NOTIFYed for it (never for another run's NOTIFY), at least every RECHECK
seconds, and once more at its deadline; it ends with the result, the failure, NotFound or
WaitTimeout."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leasework import results
from leasework.errors import NotFound, RunCancelled, RunFailed, RunPartial, WaitTimeout
from leasework.results import _Notified, _Read, _Sleep, _waiting


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def live(watched: bool = True) -> tuple[str, None, None, bool]:
    return ("running", None, None, watched)


def test_polled_through_a_pooler_at_a_growing_interval_until_the_end() -> None:
    clock = Clock()
    steps = _waiting(7, None, True, clock)
    assert next(steps) == _Read(watch=False)
    pauses = []
    action = steps.send(live(watched=False))
    for _ in range(12):
        assert isinstance(action, _Sleep)
        pauses.append(round(action.seconds, 4))
        clock.now += action.seconds
        assert steps.send(None) == _Read(watch=False)
        action = steps.send(live(watched=False))
    assert pauses[:4] == [0.05, 0.075, 0.1125, 0.1688]
    assert max(pauses) == 1.0 and pauses[-1] == 1.0
    with pytest.raises(StopIteration) as done:
        assert isinstance(action, _Sleep)
        steps.send(None)
        steps.send(("succeeded", '{"rows": 3}', None, False))
    assert done.value.value == {"rows": 3}


def test_woken_by_its_own_notify_only() -> None:
    clock = Clock()
    steps = _waiting(7, 60, False, clock)
    assert next(steps) == _Read(watch=True)
    action = steps.send(live())
    assert action == _Notified(results.RECHECK)
    clock.now += 0.5
    action = steps.send(["8", "9"])  # other runs' ends: no read, the rest of the pause
    assert isinstance(action, _Notified) and action.seconds == pytest.approx(results.RECHECK - 0.5)
    clock.now += 0.1
    assert steps.send(["7"]) == _Read(watch=False)
    with pytest.raises(RunCancelled) as cancelled:
        steps.send(("cancelled", None, "cancelled before it started", True))
    assert cancelled.value.status == "cancelled" and cancelled.value.run_id == 7


def test_a_quiet_wait_reads_again_at_the_recheck_and_times_out_after_a_last_read() -> None:
    clock = Clock()
    steps = _waiting(7, 12, False, clock)
    next(steps)
    action = steps.send(live())
    reads = 0
    while True:
        if isinstance(action, _Notified):
            clock.now += action.seconds
            action = steps.send([])
        else:
            assert action == _Read(watch=False)
            reads += 1
            try:
                action = steps.send(live())
            except WaitTimeout as exc:
                assert exc.status == "running" and exc.timeout == 12
                break
    assert reads == 3  # at 5 s, 10 s, and at the deadline (12 s)
    assert clock.now == 12


def test_an_unmarked_run_is_polled_and_its_mark_asked_for_again() -> None:
    clock = Clock()
    steps = _waiting(7, None, False, clock)
    next(steps)
    action = steps.send(live(watched=False))  # its row was held: not marked
    assert action == _Sleep(results.POLL_FIRST)
    assert steps.send(None) == _Read(watch=True)
    assert steps.send(live(watched=True)) == _Notified(results.RECHECK)


@given(
    status=st.sampled_from(["succeeded", "failed", "partial", "cancelled"]),
    result=st.one_of(st.none(), st.just('{"a": 1}')),
    error=st.one_of(st.none(), st.text(max_size=50)),
)
def test_an_ended_run_ends_the_wait_at_the_first_read(
    status: str, result: str | None, error: str | None
) -> None:
    for pooled in (False, True):
        steps = _waiting(3, 0, pooled, Clock())
        next(steps)
        value = None if result is None else {"a": 1}
        if status == "succeeded":
            with pytest.raises(StopIteration) as done:
                steps.send((status, result, error, False))
            assert done.value.value == value
            continue
        kind: Any = {"failed": RunFailed, "partial": RunPartial, "cancelled": RunCancelled}
        with pytest.raises(kind[status]) as raised:
            steps.send((status, result, error, False))
        assert raised.value.status == status and raised.value.result == value
        assert raised.value.error == error


def test_no_such_run() -> None:
    steps = _waiting(3, None, False, Clock())
    next(steps)
    with pytest.raises(NotFound, match="not committed yet"):
        steps.send(None)
