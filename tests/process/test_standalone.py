"""`leasework worker` without a supervisor: a handler blocked past its lease still runs once on
a renewed lease, a cancel interrupts it, and a handler stuck in a C call holding the GIL has its
process killed by the dead man's switch before its lease expires. It says at start that it is a
development tool."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from leasework import App
from tests.conftest import get_run, wait_for

from .conftest import BASE_CONFIG, _toml
from .test_blocking import SHORT_LEASE, LeaseSampler, add_handlers, enqueue, starts


class Standalone:
    def __init__(self, app_dir: Path, dsn: str) -> None:
        config = app_dir / "worker.toml"
        # The dead man's switch fires half the watchdog margin before the lease would expire:
        # 1.5 s here, so that noticing the death (polling, on a busy machine) comes well before.
        config.write_text(_toml({**BASE_CONFIG, **SHORT_LEASE, "watchdog_margin": 3.0}))
        self.log = app_dir / "worker.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        env.pop("LEASEWORK_CONFIG", None)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "leasework",
                    "worker",
                    "--app",
                    "lwtestapp:app",
                    "--config",
                    str(config),
                    "--dsn",
                    dsn,
                    "--log-format",
                    "json",
                ],
                cwd=app_dir,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def text(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def standalone(app_dir: Path, dsn: str, pconn: Any) -> Iterator[Standalone]:
    add_handlers(app_dir)
    worker = Standalone(app_dir, dsn)
    yield worker
    worker.stop()


def test_a_blocked_handler_runs_once_on_a_renewed_lease(
    standalone: Standalone, pconn: psycopg.Connection[Any], app_dir: Path
) -> None:
    run_id = enqueue(pconn, "sleepy", {"seconds": 10}, timeout=None)
    sampler = LeaseSampler(pconn, run_id)
    done = sampler.until(lambda r: r["status"] not in ("queued", "running"), timeout=60)
    assert done["status"] == "succeeded" and done["attempts"] == 1, done["error"]
    assert len(starts(app_dir, run_id)) == 1
    assert sampler.lapsed == []
    assert "worker_standalone" in standalone.text()
    # A cancel interrupts the next blocked handler, and the same process goes on.
    again = enqueue(pconn, "sleepy", {"seconds": 600}, timeout=None)
    wait_for(lambda: get_run(pconn, again)["status"] == "running", timeout=20)
    App().cancel(pconn, again)
    wait_for(lambda: get_run(pconn, again)["status"] == "cancelled", timeout=20)
    assert standalone.proc.poll() is None


def test_a_handler_holding_the_gil_is_killed_before_its_lease_expires(
    standalone: Standalone, pconn: psycopg.Connection[Any], app_dir: Path
) -> None:
    run_id = enqueue(pconn, "gil", {})
    wait_for(lambda: starts(app_dir, run_id), timeout=20)
    # Nothing in the process can renew while the C call holds the GIL; the kernel's timer
    # kills it before the lease it last renewed runs out.
    wait_for(lambda: standalone.proc.poll() is not None, timeout=30)
    lapsed = pconn.execute(
        "SELECT lease_expires_at < leasework.now() FROM leasework.runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert standalone.proc.returncode == -9, standalone.text()
    assert lapsed == (False,), "the process outlived its lease"
