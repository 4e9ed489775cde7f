"""A rate's window (leasework.rate_recorded, rate_used, rate_window_free_at; schema.sql) against a
model of its rule, over random histories of claims: a claim in slice c (a twentieth of the
period) counts every claim recorded in slices c - 20 and later, and one more than a period
behind the newest recorded is refused; the window frees at the start of the first slice whose
period back holds fewer claims than the rate. Whatever the order claims are recorded in (a claim
whose statement started earlier may be recorded later), and when the period changes (every claim
it keeps, two old periods back, then counts as made at the end of the newest slice)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

Conn = psycopg.Connection[Any]
BASE = datetime(2026, 3, 1, 0, 0, 0, 123457, tzinfo=UTC)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
REFUSED = 2**63 - 1

STEP = st.tuples(
    st.integers(-25_000, 60_000),  # thousandths of the period from the newest claim so far
    st.integers(1, 3),  # claims made at that moment
)


def slice_of(us: int, width: int) -> int:
    return us // width


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.sampled_from([0.5, 1.0, 10.0, 60.0, 3600.0]),
    st.lists(STEP, min_size=1, max_size=25),
    st.integers(1, 6),
)
def test_the_window_follows_its_rule(
    conn: Conn, seconds: float, steps: list[tuple[int, int]], count: int
) -> None:
    width = max(1, round(seconds * 50_000))
    period_us = int(seconds * 1_000_000)
    win: Any = None
    recorded: list[tuple[int, int]] = []  # (slice, claims)
    base_us = (BASE - EPOCH) // timedelta(microseconds=1)
    at_us = base_us  # microseconds since the epoch
    for step, n in steps:
        newest = max((s for s, _ in recorded), default=None)
        start = base_us if newest is None else newest * width
        at = EPOCH + timedelta(microseconds=max(base_us, start + step * period_us // 1000))
        c = slice_of((at - EPOCH) // timedelta(microseconds=1), width)
        row = conn.execute(
            "SELECT leasework.rate_used(%s, %s, %s), leasework.rate_window_free_at(%s, %s, %s, %s)",
            (win, seconds, at, win, count, seconds, at),
        ).fetchone()
        assert row is not None
        used, free_at = row
        if newest is not None and c < newest - 20:
            assert used == REFUSED
            continue
        expected = sum(k for s, k in recorded if s >= c - 20)
        assert used == expected, (used, expected, recorded, c)
        if expected < count:
            assert free_at == at
        else:
            # The first slice s > c whose period back holds fewer than `count`.
            s = c + 1
            while sum(k for t, k in recorded if t >= s - 20) >= count:
                s += 1
            assert free_at == EPOCH + timedelta(microseconds=s * width), (free_at, s)
        got = conn.execute(
            "SELECT leasework.rate_recorded(%s, %s, %s, %s)", (win, seconds, at, n)
        ).fetchone()
        assert got is not None
        win = got[0]
        recorded.append((c, n))
        at_us = (at - EPOCH) // timedelta(microseconds=1)
    # Read under a period twice as long: every claim the window keeps (two old periods back)
    # counts, as made at the end of the newest slice.
    newest = max(t for t, _ in recorded)
    total = sum(k for t, k in recorded if t >= newest - 40)
    at = EPOCH + timedelta(microseconds=at_us)
    row = conn.execute("SELECT leasework.rate_used(%s, %s, %s)", (win, seconds * 2, at)).fetchone()
    assert row is not None and row[0] == total
