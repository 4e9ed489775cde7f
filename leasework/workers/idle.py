"""How long an idle worker may sleep: pure decisions, time passed in. A stage that found nothing
rests until it is next due by what it saw (a delayed run, a lease running out, a schedule, a
maintenance period), at most `idle_poll_max`; the worker sleeps until the first rest ends or a
NOTIFY names a stage. Without a wake-up (behind a pooler with no LISTEN) nothing would end a
long rest early, so every rest is at most `poll_interval`. Never touches the database."""

from __future__ import annotations

from collections.abc import Iterable

# A stage told "due in t seconds" is asked a little after t, so that its statement (which compares
# with the database's now, not ours) finds the run due rather than a hair early and idle again.
LATE = 0.005


def rest(
    due: float | None,
    poll_interval: float,
    idle_poll_max: float,
    *,
    wakes: bool,
    exact: bool = False,
) -> float:
    """Seconds a stage that found nothing may rest. `due`: seconds until it is next due by what it
    saw; None: nothing until a NOTIFY; 0 or less: due already yet not taken, or unknown (a stage
    that cannot tell), so it is asked every poll_interval as before. `wakes`: a NOTIFY can end
    the worker's wait (else the cap is poll_interval: a new run would go unseen). `exact`: only
    the stage itself makes its work due (maintenance's periods), so a known due time is kept
    past idle_poll_max, the cap being there for what a worker cannot see coming."""
    cap = max(idle_poll_max, poll_interval) if wakes else poll_interval
    if due is None:
        return cap
    if due <= 0:
        return min(poll_interval, cap)
    if exact and wakes:
        return due + LATE
    return min(due + LATE, cap)


def earliest(dues: Iterable[float | None]) -> float | None:
    """The soonest of several due times (seconds; None: nothing): None only if all are None. A
    0 (unknown) wins, so one part that cannot tell keeps its stage polled every poll_interval."""
    known = [d for d in dues if d is not None]
    return min(known) if known else None


def timeout(now: float, rest_until: Iterable[float], default: float) -> float:
    """Seconds an idle wait may last: until the first stage's rest ends (`rest_until`, monotonic
    times); `default` when there is no stage."""
    until = list(rest_until)
    if not until:
        return default
    return max(0.0, min(until) - now)


# What a stage saw of its next due time: (seconds until due then, None: nothing; the monotonic
# time it read it), or None if its last step did not read it.
Seen = tuple[float | None, float] | None


def due_now(seen: Seen, now: float) -> float | None:
    """A due time a stage read at some monotonic time, as seconds from `now` (what
    `Due.next_due` returns); 0 (unknown) if it read none."""
    if seen is None:
        return 0.0
    due, at = seen
    return None if due is None else due - (now - at)
