"""Hypothesis draws fault schedules (tests/faults/schedules.py: kill -9, SIGSTOP, partition, slow
link, killed sessions, Postgres crash and pause, cancels, bursts of new runs) and plays each
against a real supervisor on a fresh private cluster; every invariant must hold afterwards.

Many examples, here in `make chaos`; a couple run in `make test`
(tests/process/test_fault_schedules.py). No shrinking (each example costs seconds of real
processes). On failure the seed and the schedule are printed; copy the schedule into an
`@example` to keep it as a regression test."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.faults.schedules import COMMON, SCHEDULES, Step, _check_schedule


@settings(max_examples=int(os.environ.get("LEASEWORK_CHAOS_EXAMPLES", "20")), **COMMON)
@given(seed=st.integers(0, 2**32 - 1), schedule=SCHEDULES)
@example(seed=1, schedule=[("pg_pause", 0.0, 1.5), ("kill9", 0.0, 0.0), ("blackhole", 0.1, 2.0)])
# Runs enqueued right after a Postgres restart, before the idle workers LISTENed again: their
# NOTIFYs reached nobody and the workers slept idle_poll_max (found by this test; fixed in
# workers/wakeup.py: a worker that LISTENs anew asks every stage first).
@example(
    seed=4294967294,
    schedule=[
        ("sigstop", 0.78, 1.1),
        ("pg_crash", 0.1, 0.0),
        ("burst", 1e-05, 8.0),
        ("terminate_control", 0.05, 0.0),
        ("delay", 0.26, 0.08),
        ("pg_pause", 0.14, 0.67),
    ],
)
def test_random_fault_schedules(tmp_path: Path, seed: int, schedule: list[Step]) -> None:
    _check_schedule(tmp_path, seed, schedule)


@settings(max_examples=int(os.environ.get("LEASEWORK_CHAOS_EXAMPLES", "20")) // 2, **COMMON)
@given(seed=st.integers(0, 2**32 - 1), schedule=SCHEDULES)
def test_random_fault_schedules_through_pgbouncer(
    tmp_path: Path, seed: int, schedule: list[Step]
) -> None:
    """The same schedules with every child behind a PgBouncer in transaction mode
    (tests/chaos/test_pooler_faults.py)."""
    _check_schedule(tmp_path, seed, schedule, pooled=True)
