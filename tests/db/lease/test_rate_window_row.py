"""A kind's rate window in shards (leasework.rate_shards, migration 0035; its narrow row of 0031
before): the quick statement's rated form writes one shard's row alone, as a HOT update, and
never the kind's limits row; its inlined count and record (leasework.rate_used_fast,
rate_recorded_fast) give exactly what leasework.rate_used and rate_recorded give; the shards'
shares add up to the rate, and a rate changed at run time splits the window again, the claims
made before carried (admit counts them against the whole rate, the quick statement waits for
them to count nothing); admit splits a window that has no shard. Time moves by the database
clock."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leasework import operations

from ...conftest import shift_clock
from ..checks import KINDS, claim_one, make_app
from .test_rates import rated_quick, window_count

Conn = psycopg.Connection[Any]


def rate(conn: Conn, **limits: Any) -> None:
    operations.set_limits(conn, "job", known=KINDS, **limits)


def shards(conn: Conn) -> list[tuple[Any, ...]]:
    """(shard, share, win, carried) of the kind's shards, in order."""
    return conn.execute(
        "SELECT shard, share, win, carried FROM leasework.rate_shards WHERE kind = 'job'"
        " ORDER BY shard"
    ).fetchall()


def limits_row_version(conn: Conn) -> str:
    row = conn.execute(
        "SELECT xmin::text || ctid::text FROM leasework.kind_limits WHERE kind = 'job'"
    ).fetchone()
    assert row is not None
    return str(row[0])


@pytest.mark.parametrize("one", [True, False], ids=["one-kind", "several-kinds"])
def test_a_rated_quick_claim_writes_one_shard_alone_as_a_hot_update(conn: Conn, one: bool) -> None:
    app = make_app()
    ids = app.enqueue_many(conn, "job", [{} for _ in range(4)])
    rate(conn, rate="1000/1h", max_running=10)
    first = claim_one(conn, "w1", ["job"])
    assert first is not None and window_count(conn) == 1
    before = limits_row_version(conn)
    counts = (
        "SELECT pg_stat_get_xact_tuples_updated('leasework.rate_shards'::regclass),"
        "       pg_stat_get_xact_tuples_hot_updated('leasework.rate_shards'::regclass),"
        "       pg_stat_get_xact_tuples_updated('leasework.kind_limits'::regclass)"
    )
    with conn.transaction():
        # This backend's counts not yet reported (the claim above's too): before and after.
        was = conn.execute(counts).fetchone()
        got = rated_quick(conn, first, one)
        now = conn.execute(counts).fetchone()
    assert was is not None and now is not None
    row = tuple(b - a for a, b in zip(was, now, strict=True))
    assert got == [ids[1]] and window_count(conn) == 2
    assert row == (1, 1, 0), "the window's write was not one HOT update of one shard"
    assert limits_row_version(conn) == before, "the kind's limits row was written"


@pytest.mark.parametrize(
    ("count", "shares"),
    [(1, [1]), (3, [1, 1, 1]), (8, [1] * 8), (10, [2, 2, 1, 1, 1, 1, 1, 1]),
     (1000, [125] * 8), (1000000, [125000] * 8)],
)  # fmt: skip
def test_the_shares_add_up_to_the_rate(conn: Conn, count: int, shares: list[int]) -> None:
    rate(conn, rate=f"{count}/1m")
    assert [s[1] for s in shards(conn)] == shares and sum(shares) == count


# Windows as claims leave them (rate_recorded from nothing, claims at random moves of the clock,
# the period changed between), read and recorded at random moments: the inlined forms agree.
WINDOW = st.lists(st.tuples(st.sampled_from([1.0, 10.0, 60.0, 3600.0]), st.floats(0, 4000)), max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(WINDOW, st.sampled_from([1.0, 10.0, 60.0, 3600.0]), st.floats(-200, 8000))
def test_the_inlined_count_and_record_match_rate_used_and_rate_recorded(
    conn: Conn, claims: list[tuple[float, float]], seconds: float, later: float
) -> None:
    row = conn.execute(
        """
        WITH RECURSIVE c AS (
            SELECT 0 AS i, NULL::bigint[] AS win, 0::float8 AS t
            UNION ALL
            SELECT c.i + 1, leasework.rate_recorded(c.win, (%(claims)s::float8[])[c.i + 1][1],
                                                    timestamptz '2026-01-01' + make_interval(
                                                        secs => c.t + (%(claims)s::float8[])[c.i + 1][2]), 1),
                   c.t + (%(claims)s::float8[])[c.i + 1][2]
              FROM c WHERE c.i < %(n)s
        ), w AS (SELECT win, timestamptz '2026-01-01' + make_interval(secs => t + %(later)s) AS at
                   FROM c ORDER BY i DESC LIMIT 1)
        SELECT leasework.rate_used_fast(win, %(seconds)s, at) = leasework.rate_used(win, %(seconds)s, at),
               leasework.rate_recorded_fast(win, %(seconds)s, at)
                   = leasework.rate_recorded(win, %(seconds)s, at, 1)
          FROM w
        """,
        {"claims": [list(c) for c in claims] or [[1.0, 0.0]], "n": len(claims),
         "later": later, "seconds": seconds},
    ).fetchone()  # fmt: skip
    assert row == (True, True)


def test_a_rate_changed_at_run_time_carries_its_claims_until_they_count_nothing(conn: Conn) -> None:
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(12)])
    rate(conn, rate="16/1m")
    taken = [claim_one(conn, f"w{i}", ["job"]) for i in range(4)]
    assert all(taken) and window_count(conn) == 4
    rate(conn, rate="5/1m")  # lowered: the 4 claims carried, counted against the new rate
    assert {s[3] is not None for s in shards(conn)} == {True} and window_count(conn) == 4
    last = taken[-1]
    assert last is not None
    assert rated_quick(conn, last, one=True) == [], "the quick statement took a carried shard"
    assert claim_one(conn, "w5", ["job"]) is not None  # admit: 4 carried + 1 = 5
    assert claim_one(conn, "w6", ["job"]) is None, "admitted past the lowered rate"
    shift_clock(conn, 63.5)  # a period and a slice on: the carried claims count nothing
    again = claim_one(conn, "w7", ["job"])
    assert again is not None and all(s[3] is None for s in shards(conn))
    # Lean: the leases of the runs claimed above ran out meanwhile (the probed form sees them).
    assert len(rated_quick(conn, again, one=True, probed=False)) == 1, "the shards stayed closed"


def test_admit_splits_a_window_without_shards_and_a_rated_claim_needs_one(conn: Conn) -> None:
    app = make_app()
    ids = app.enqueue_many(conn, "job", [{} for _ in range(3)])
    rate(conn, rate="10/1m")
    first = claim_one(conn, "w1", ["job"])
    assert first is not None and len(shards(conn)) == 8
    conn.execute("DELETE FROM leasework.rate_shards")  # as if the window were never split
    assert rated_quick(conn, first, one=True) == [], "a claim recorded in no window"
    second = claim_one(conn, "w2", ["job"])
    assert second is not None and second.id == ids[1] and window_count(conn) == 1
    assert len(shards(conn)) == 8


def test_a_rate_changed_with_few_claims_counting_keeps_them_in_the_first_shard(conn: Conn) -> None:
    # Claims that fit in the first shard's share go there: the quick statement goes on at once.
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(6)])
    rate(conn, rate="1000/1h")
    taken = [claim_one(conn, f"w{i}", ["job"]) for i in range(3)]
    assert all(taken) and window_count(conn) == 3
    rate(conn, rate="2000/1h")
    rows = shards(conn)
    assert [r[1] for r in rows] == [250] * 8 and all(r[3] is None for r in rows)
    assert rows[0][2] is not None and all(r[2] is None for r in rows[1:])
    assert window_count(conn) == 3
    last = taken[-1]
    assert last is not None and len(rated_quick(conn, last, one=True)) == 1
    assert window_count(conn) == 4


def test_a_rated_quick_claim_goes_on_beside_an_admit_in_flight(conn: Conn, dsn: str) -> None:
    # An admit locks the shards it needs one at a time (one here, for one run), not all of them:
    # another worker's quick claim takes another shard at once, without waiting for its commit.
    app = make_app()
    ids = app.enqueue_many(conn, "job", [{} for _ in range(4)])
    rate(conn, rate="1000/1h")
    first = claim_one(conn, "w1", ["job"])
    assert first is not None
    with psycopg.connect(dsn, autocommit=True) as other:
        other.execute("SET lock_timeout = '2s'")
        with other.transaction():
            assert claim_one(other, "w2", ["job"]) is not None  # admitted, not committed
            conn.execute("SET lock_timeout = '500ms'")
            got = rated_quick(conn, first, one=True, probed=False)
            conn.execute("RESET lock_timeout")
        assert got == [ids[2]], "the quick claim found no shard free beside the admit"
    assert window_count(conn) == 3


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.floats(0.1, 604800), st.integers(-(2**40), 2**52))
def test_the_slice_read_from_an_interval_is_the_slice_of_the_epoch(
    conn: Conn, seconds: float, micros: int
) -> None:
    # leasework.rate_slice reads `at - epoch` (immutable, so it inlines): the same slice as
    # extract(epoch FROM at), the form before migration 0035.
    row = conn.execute(
        "SELECT leasework.rate_slice(%(s)s, a) = floor(extract(epoch FROM a) * 1000000"
        "       / greatest(1, round(%(s)s * 50000))::bigint)::bigint"
        "  FROM (SELECT timestamptz 'epoch' + make_interval(secs => %(m)s / 1e6) AS a) t",
        {"s": seconds, "m": micros},
    ).fetchone()
    assert row == (True,)
