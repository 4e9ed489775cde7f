"""Shared fixtures. Tests talk to a real Postgres: LEASEWORK_TEST_DSN, else the server on
127.0.0.1:5432, else an embedded one (the `embedded` extra). Each test session makes its own
database and drops it at the end; each database test starts from empty leasework tables. The
folder says a test's tier (tests/README.md): every test under tests/chaos carries the `chaos`
marker, given here, and no test elsewhere may."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import settings
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from leasework import App, Config, db, operations
from leasework.pytest_plugin import empty
from leasework.workers.worker import Worker

from . import clock

# The fault harness's `chaos` fixture, for the process tier's fault tests and the chaos tier's.
pytest_plugins = ("tests.faults.plugin",)

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
CHAOS_TIER = Path(__file__).resolve().parent / "chaos"

# Property tests draw the same examples on every run of the suite: a new find must not turn an
# unrelated change's CI red at random. `make fuzz` searches afresh (random seeds, every property
# test five times over); a find goes in as a regression test.
settings.register_profile("suite", derandomize=True)
settings.register_profile("fuzz", derandomize=False)
# Not a LEASEWORK_ variable: the CLI warns of every one that is no setting (config.loader).
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`-m chaos` and `-m 'not chaos'` select by folder: `make chaos` runs tests/chaos, `make
    test` everything else."""
    for item in items:
        if CHAOS_TIER in item.path.resolve().parents:
            item.add_marker(pytest.mark.chaos)
        elif item.get_closest_marker("chaos") is not None:
            raise pytest.UsageError(f"{item.nodeid} is marked chaos: chaos tests go in tests/chaos")


def _server_dsn() -> str:
    explicit = os.environ.get("LEASEWORK_TEST_DSN")
    if explicit:
        return explicit
    try:
        with psycopg.connect(DEFAULT_SERVER, connect_timeout=3):
            return DEFAULT_SERVER
    except psycopg.OperationalError:
        pass
    try:
        import pgserver  # type: ignore[import-not-found]
    except ImportError:
        pytest.exit("no Postgres: set LEASEWORK_TEST_DSN or run one on 127.0.0.1:5432", 2)
    server = pgserver.get_server(
        os.path.join(os.getcwd(), ".leasework", "testdb"), cleanup_mode="stop"
    )
    return str(server.get_uri())


@pytest.fixture(scope="session")
def server_dsn() -> str:
    return _server_dsn()


@pytest.fixture(scope="session")
def dsn(server_dsn: str) -> Iterator[str]:
    """A fresh database for this test session, migrated, dropped at the end."""
    name = f"leasework_test_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = conninfo_to_dict(server_dsn)
    params["dbname"] = name
    test_dsn = make_conninfo(**params)
    with psycopg.connect(test_dsn, autocommit=True) as conn:
        db.migrate(conn)
        clock.install(conn)  # a leasework.now() that shift_clock moves
    yield test_dsn
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def truncate_all(conn: psycopg.Connection[Any]) -> None:
    """Empty every leasework table except the schema version (what the pytest plugin shipped to
    users does before each of their tests)."""
    empty(conn)


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to an emptied test database."""
    with psycopg.connect(dsn, autocommit=True) as c:
        truncate_all(c)
        yield c


def fast_config(dsn: str, **overrides: Any) -> Config:
    """Seed semantics with timings small enough for tests (never used to sleep out a lease)."""
    base: dict[str, Any] = {
        "dsn": dsn,
        "poll_interval": 0.05,
        "lease": 30.0,
        "renew_interval": 10.0,
        "control_interval": 0.5,
        "pool_size": 3,
    }
    base.update(overrides)
    return Config.make(**base)


@pytest.fixture
def make_worker(dsn: str, conn: psycopg.Connection[Any]) -> Iterator[Callable[..., Worker]]:
    """make_worker(app, keeper_thread=False, **config_overrides) -> an opened Worker, closed
    after the test. Without its keeper's thread by default: the lease work then happens in
    ctx.check() only, so a test that moves lease columns is not raced by a background renewal
    (tests of the keeper itself turn it on)."""
    made: list[Worker] = []

    def factory(app: App, keeper_thread: bool = False, **overrides: Any) -> Worker:
        cfg = fast_config(dsn, **overrides)
        worker = Worker(app.with_config(cfg), cfg, keeper_thread=keeper_thread)
        worker.open()
        worker.running = True
        made.append(worker)
        return worker

    yield factory
    for w in made:
        w.close()


def expire_lease(conn: psycopg.Connection[Any], run_id: int) -> None:
    """Move a run's lease into the past, as if its holder had gone silent for the whole lease."""
    conn.execute(
        "UPDATE leasework.runs SET lease_expires_at = leasework.now() - interval '1 second' WHERE id = %s",
        (run_id,),
    )


def make_due(conn: psycopg.Connection[Any], run_id: int) -> None:
    """Move a requeued run's queued_at to now, as if its backoff had passed."""
    conn.execute("UPDATE leasework.runs SET queued_at = leasework.now() WHERE id = %s", (run_id,))


def shift_clock(conn: psycopg.Connection[Any], seconds: float) -> None:
    """Move this connection's idea of database time (leasework.now()) by `seconds` from real now:
    the session database's clock is movable (tests/clock.py)."""
    conn.execute("SELECT set_config('leasework.now_offset', %s, false)", (f"{seconds} seconds",))


def get_run(conn: psycopg.Connection[Any], run_id: int) -> dict[str, Any]:
    """Every column of a run, its history as every reader shows it (operations.get_run)."""
    row = operations.get_run(conn, run_id)
    assert row is not None, f"run {run_id} not found"
    return row


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Wait on a condition with a deadline (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
