"""A kind's rate window in its own narrow row (leasework.rate_windows, migration 0031): the quick
statement's rated form writes that row alone, as a HOT update, and never the kind's limits row;
its expressions for a claim in the window's newest slice record exactly what
leasework.rate_recorded records, in that slice, past it, and under a period changed at run time;
admit makes the row and locks it before it reads. Time moves by the database clock."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import psycopg
import pytest

from leasework import operations

from ...conftest import shift_clock
from ..checks import KINDS, claim_one, make_app
from .test_rates import rated_quick, window_count

Conn = psycopg.Connection[Any]


def rate(conn: Conn, **limits: Any) -> None:
    operations.set_limits(conn, "job", known=KINDS, **limits)


def window(conn: Conn) -> list[int] | None:
    row = conn.execute("SELECT win FROM leasework.rate_windows WHERE kind = 'job'").fetchone()
    return None if row is None else row[0]


def limits_row_version(conn: Conn) -> str:
    row = conn.execute(
        "SELECT xmin::text || ctid::text FROM leasework.kind_limits WHERE kind = 'job'"
    ).fetchone()
    assert row is not None
    return str(row[0])


@pytest.mark.parametrize("one", [True, False], ids=["one-kind", "several-kinds"])
def test_a_rated_quick_claim_writes_the_narrow_row_alone_as_a_hot_update(
    conn: Conn, one: bool
) -> None:
    app = make_app()
    ids = app.enqueue_many(conn, "job", [{} for _ in range(4)])
    rate(conn, rate="1000/1h", max_running=10)
    first = claim_one(conn, "w1", ["job"])  # admit: makes the window's row
    assert first is not None and window_count(conn) == 1
    before = limits_row_version(conn)
    counts = (
        "SELECT pg_stat_get_xact_tuples_updated('leasework.rate_windows'::regclass),"
        "       pg_stat_get_xact_tuples_hot_updated('leasework.rate_windows'::regclass),"
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
    assert row == (1, 1, 0), "the window's write was not one HOT update of its own row"
    assert limits_row_version(conn) == before, "the kind's limits row was written"


# Clock moves between rated claims (seconds), for a rate of 1000/1h (slices of 180 s): the same
# slice, the next, some slices on, past the kept window, back within a period (a claim whose
# statement started earlier), and a period changed at run time (then the same slice again).
MOVES = [0, 1, 2, 200, 205, 1000, 9000, 8990, ("period", "1000/30m"), 9001, 9002, 9100]


def test_the_rated_claims_record_what_rate_recorded_records(conn: Conn) -> None:
    app = make_app()
    app.enqueue_many(conn, "job", [{} for _ in range(len(MOVES) + 2)])
    rate(conn, rate="1000/1h")
    run = claim_one(conn, "w1", ["job"])
    assert run is not None
    seconds = 3600.0
    for move in MOVES:
        if isinstance(move, tuple):
            rate(conn, rate=move[1])
            seconds = 1800.0
            continue
        shift_clock(conn, move)
        with conn.transaction():
            # In the claim's own transaction: the same leasework.now() as the claim's.
            row = conn.execute(
                "SELECT leasework.rate_recorded(win, %s, leasework.now(), 1)"
                "  FROM leasework.rate_windows WHERE kind = 'job'",
                (seconds,),
            ).fetchone()
            assert row is not None
            got = rated_quick(conn, run, one=True)
            assert len(got) == 1, f"no claim at {move}"
            assert window(conn) == row[0], f"the window recorded otherwise at {move}"
        nxt = conn.execute(
            "SELECT id, lease_owner FROM leasework.runs WHERE id = %s", (got[0],)
        ).fetchone()
        assert nxt is not None
        run = replace(run, id=nxt[0], owner=nxt[1])


def test_the_rated_claim_stops_at_the_rate_in_the_newest_slice(conn: Conn) -> None:
    # The common case's expressions decide alone here (every claim in one slice of 180 s).
    app = make_app()
    ids = app.enqueue_many(conn, "job", [{} for _ in range(5)])
    rate(conn, rate="3/1h")
    run = claim_one(conn, "w1", ["job"])
    assert run is not None
    got = rated_quick(conn, run, one=True)
    assert got == [ids[1]]
    nxt = claim_one(conn, "w2", ["job"])
    assert nxt is not None and nxt.id == ids[2] and window_count(conn) == 3
    assert rated_quick(conn, nxt, one=True) == [], "the rated claim went past the rate"
    assert window_count(conn) == 3
    win = window(conn)
    assert (
        win is not None
        and win[1]
        == conn.execute("SELECT leasework.rate_slice(3600, leasework.now())").fetchone()[0]
    )  # type: ignore[index]
    shift_clock(conn, 3600 + 200)
    again = claim_one(conn, "w3", ["job"])
    assert again is not None and window_count(conn) == 1


def test_admit_makes_the_window_and_a_rated_claim_needs_it(conn: Conn) -> None:
    app = make_app()
    ids = app.enqueue_many(conn, "job", [{} for _ in range(3)])
    rate(conn, rate="10/1m")
    first = claim_one(conn, "w1", ["job"])
    assert first is not None and window(conn) is not None
    conn.execute("DELETE FROM leasework.rate_windows")  # as if the row were never made
    assert rated_quick(conn, first, one=True) == [], "a claim recorded in no window"
    second = claim_one(conn, "w2", ["job"])
    assert second is not None and second.id == ids[1] and window_count(conn) == 1
