"""Backoff is a pure decision: the seed's 5 s / 30 s / 2 min, each x uniform(0.8, 1.2), the last
repeating, and a handler's Retry-After always wins (a number of seconds from 0 to 30 days, checked
where the Retry is raised)."""

from __future__ import annotations

import random
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leasework.errors import MAX_RETRY_AFTER, Retry
from leasework.workers.backoff import backoff_delay, retry_delay

SEED_SCHEDULE = (5.0, 30.0, 120.0)

schedules = st.lists(
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False), min_size=1, max_size=6
).map(tuple)
jitters = st.floats(min_value=0.0, max_value=0.99)
attempts = st.integers(min_value=1, max_value=1000)
seeds = st.integers(min_value=0, max_value=2**32 - 1)


@given(attempt=attempts, schedule=schedules, jitter=jitters, seed=seeds)
def test_delay_is_the_scheduled_step_within_the_jitter_window(
    attempt: int, schedule: tuple[float, ...], jitter: float, seed: int
) -> None:
    base = schedule[min(attempt, len(schedule)) - 1]
    delay = backoff_delay(attempt, schedule, jitter, random.Random(seed))
    tolerance = 1e-9 * max(1.0, base)
    assert base * (1 - jitter) - tolerance <= delay <= base * (1 + jitter) + tolerance


@given(attempt=st.integers(min_value=3, max_value=10_000), seed=seeds)
def test_the_last_step_repeats(attempt: int, seed: int) -> None:
    delay = backoff_delay(attempt, SEED_SCHEDULE, 0.2, random.Random(seed))
    assert 96.0 <= delay <= 144.0


@given(seed=seeds)
def test_seed_figures(seed: int) -> None:
    rand = random.Random(seed)
    assert 4.0 <= backoff_delay(1, rand=rand) <= 6.0
    assert 24.0 <= backoff_delay(2, rand=rand) <= 36.0
    assert 96.0 <= backoff_delay(3, rand=rand) <= 144.0


@given(attempt=attempts, schedule=schedules, jitter=jitters, seed=seeds)
def test_same_randomness_same_delay(
    attempt: int, schedule: tuple[float, ...], jitter: float, seed: int
) -> None:
    first = backoff_delay(attempt, schedule, jitter, random.Random(seed))
    assert backoff_delay(attempt, schedule, jitter, random.Random(seed)) == first


def test_jitter_spreads_the_retries() -> None:
    """No synchronized stampede: many workers failing at once retry at spread-out times."""
    rand = random.Random(7)
    delays = [backoff_delay(1, SEED_SCHEDULE, 0.2, rand) for _ in range(500)]
    assert len(set(delays)) == len(delays)
    assert min(delays) < 4.2 and max(delays) > 5.8


def test_no_jitter_is_exact() -> None:
    assert backoff_delay(2, SEED_SCHEDULE, 0.0, random.Random(1)) == 30.0


@given(attempt=st.integers(max_value=0))
def test_attempts_are_one_based(attempt: int) -> None:
    with pytest.raises(ValueError):
        backoff_delay(attempt)


@given(
    attempt=attempts,
    after=st.floats(min_value=0.0, max_value=1e7, allow_nan=False),
    schedule=schedules,
    jitter=jitters,
    seed=seeds,
)
def test_retry_after_wins(
    attempt: int, after: float, schedule: tuple[float, ...], jitter: float, seed: int
) -> None:
    assert retry_delay(attempt, after, schedule, jitter, random.Random(seed)) == after


@given(attempt=attempts, schedule=schedules, jitter=jitters, seed=seeds)
def test_without_retry_after_the_backoff_applies(
    attempt: int, schedule: tuple[float, ...], jitter: float, seed: int
) -> None:
    expected = backoff_delay(attempt, schedule, jitter, random.Random(seed))
    assert retry_delay(attempt, None, schedule, jitter, random.Random(seed)) == expected


def test_retry_after_is_a_number_of_seconds_within_the_cap() -> None:
    assert Retry().after is None
    assert Retry(after=0).after == 0.0
    assert Retry(after=Fraction(3, 2)).after == 1.5
    assert Retry(after=MAX_RETRY_AFTER).after == MAX_RETRY_AFTER == 30 * 24 * 3600
    bad: list[Any] = [
        float("inf"),
        float("-inf"),
        float("nan"),
        -0.5,
        MAX_RETRY_AFTER + 0.001,
        1e10,
        10**400,  # too large for a float: still a clear ValueError, not an OverflowError
        True,
        False,
        "30",
        [30],
    ]
    for after in bad:
        with pytest.raises(ValueError) as caught:
            Retry(after=after)
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith("Retry(after=") and message.endswith(
            "): after must be a number of seconds from 0 to 2592000 (30 days), or None for the"
            " backoff"
        )
