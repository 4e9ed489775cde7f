"""Pure retry decisions: how long a failed attempt waits before the next. Takes its randomness
as an argument so it can be tested exhaustively."""

from __future__ import annotations

import random
from collections.abc import Sequence


def backoff_delay(
    attempt: int,
    schedule: Sequence[float] = (5.0, 30.0, 120.0),
    jitter: float = 0.2,
    rand: random.Random | None = None,
) -> float:
    """Delay before the attempt after `attempt` (1-based): schedule[attempt-1], the last entry
    repeating, times uniform(1 - jitter, 1 + jitter). Jitter keeps an outage's recovery from
    becoming a synchronized retry stampede."""
    if attempt < 1:
        raise ValueError("attempt is 1-based")
    base = schedule[min(attempt, len(schedule)) - 1]
    factor = (rand or random).uniform(1.0 - jitter, 1.0 + jitter)
    return base * factor


def retry_delay(
    attempt: int,
    after: float | None,
    schedule: Sequence[float],
    jitter: float,
    rand: random.Random | None = None,
) -> float:
    """A handler's (or provider's) Retry-After wins over the backoff."""
    if after is not None:
        return after
    return backoff_delay(attempt, schedule, jitter, rand)
