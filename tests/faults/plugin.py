"""The fault harness's fixture, loaded for the whole tree (tests/conftest.py `pytest_plugins`: the
process tier's fault tests use it as the chaos tier's do): each test gets its own private
Postgres cluster (so it may crash, pause and restart it) and a `ChaosRun` on it; every supervisor
started is stopped afterwards."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.pgcluster import private_cluster

from .harness import SUMMARY, ChaosRun


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per chaos run: runs, faults by type, violations, worst recovery time."""
    if SUMMARY:
        terminalreporter.section("chaos summary")
        for line in SUMMARY:
            terminalreporter.write_line(line)


@pytest.fixture
def chaos(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., ChaosRun]]:
    """chaos(seed=None, through_pooler=False, app=None, **config) -> a ChaosRun on a fresh
    private cluster (through_pooler: behind a PgBouncer in transaction mode; app: the app its
    supervisors run, default tests.faults.chaosapp:app)."""
    runs: list[ChaosRun] = []
    with private_cluster("leasework-chaos-") as cluster:

        def make(
            seed: int | None = None,
            through_pooler: bool = False,
            app: str | None = None,
            **config: Any,
        ) -> ChaosRun:
            seed = random.randrange(1 << 32) if seed is None else seed
            print(f"chaos seed {seed}")
            run = ChaosRun(
                cluster,
                tmp_path,
                request.node.name,
                dict(config),
                random.Random(seed),
                pooled=through_pooler,
                app=app or "tests.faults.chaosapp:app",
            )
            runs.append(run)
            return run

        try:
            yield make
        finally:
            for run in runs:
                run.stop()
