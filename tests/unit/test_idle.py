"""How long an idle worker may sleep (leasework/workers/idle.py): pure, hypothesis-tested."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from leasework.workers import idle

seconds = st.floats(min_value=0.01, max_value=3600, allow_nan=False)
due = st.none() | st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@given(due=due, poll=seconds, cap=seconds, wakes=st.booleans())
def test_a_rest_is_positive_and_never_longer_than_its_cap(
    due: float | None, poll: float, cap: float, wakes: bool
) -> None:
    rest = idle.rest(due, poll, cap, wakes=wakes)
    assert 0 < rest <= (max(cap, poll) if wakes else poll)


@given(due=due, poll=seconds, cap=seconds, exact=st.booleans())
def test_without_a_wake_up_nothing_rests_longer_than_poll_interval(
    due: float | None, poll: float, cap: float, exact: bool
) -> None:
    """Behind a pooler with no LISTEN a new run is seen only by polling."""
    assert idle.rest(due, poll, cap, wakes=False, exact=exact) <= poll


@given(due=st.floats(min_value=1e-6, max_value=1e6), poll=seconds, cap=seconds)
def test_an_exact_due_time_is_kept_past_the_cap(due: float, poll: float, cap: float) -> None:
    assert idle.rest(due, poll, cap, wakes=True, exact=True) == due + idle.LATE
    assert idle.rest(None, poll, cap, wakes=True, exact=True) == max(cap, poll)


@given(poll=seconds, cap=seconds)
def test_nothing_due_rests_the_cap_and_unknown_or_past_rests_poll_interval(
    poll: float, cap: float
) -> None:
    assert idle.rest(None, poll, cap, wakes=True) == max(cap, poll)
    assert idle.rest(0.0, poll, cap, wakes=True) == poll  # a stage that cannot tell
    assert idle.rest(-5.0, poll, cap, wakes=True) == poll  # due yet not taken: no busy loop


@given(due=st.floats(min_value=1e-6, max_value=1e6), poll=seconds, cap=seconds)
def test_a_known_due_time_is_kept_to_within_the_cap(due: float, poll: float, cap: float) -> None:
    """Never asked before it is due (so it finds the run due), never much after."""
    rest = idle.rest(due, poll, cap, wakes=True)
    assert rest == min(due + idle.LATE, max(cap, poll))


@given(now=st.floats(0, 1e6), rests=st.lists(st.floats(0, 2e6), min_size=1))
def test_the_wait_ends_with_the_first_rest(now: float, rests: list[float]) -> None:
    assert idle.timeout(now, rests, 2.0) == max(0.0, min(rests) - now)
    assert idle.timeout(now, [], 2.0) == 2.0


@given(dues=st.lists(due))
def test_earliest_ignores_nothing_and_keeps_unknown(dues: list[float | None]) -> None:
    known = [d for d in dues if d is not None]
    assert idle.earliest(dues) == (min(known) if known else None)
    assert idle.earliest([*dues, 0.0]) is not None and idle.earliest([*dues, 0.0]) <= 0.0  # type: ignore[operator]


def test_a_due_time_read_earlier_counts_down() -> None:
    assert idle.due_now(None, 10.0) == 0.0  # not read: unknown
    assert idle.due_now((None, 5.0), 10.0) is None
    assert idle.due_now((30.0, 5.0), 10.0) == 25.0
