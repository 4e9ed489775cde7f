"""Hypothesis draws a couple of fault schedules (tests/faults/schedules.py) and plays each against
a real supervisor on a fresh private cluster; every invariant must hold afterwards. Many more are
tests/chaos/test_schedules.py's (`make chaos`). No shrinking (each example costs seconds of real
processes). On failure the seed and the schedule are printed; copy the schedule into an
`@example` to keep it as a regression test."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.faults.schedules import COMMON, SCHEDULES, Step, _check_schedule


@settings(max_examples=int(os.environ.get("LEASEWORK_CHAOS_FAST_EXAMPLES", "2")), **COMMON)
@given(seed=st.integers(0, 2**32 - 1), schedule=SCHEDULES)
def test_random_fault_schedules_fast(tmp_path: Path, seed: int, schedule: list[Step]) -> None:
    _check_schedule(tmp_path, seed, schedule)
