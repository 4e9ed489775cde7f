"""Cancel: a queued or waiting run ends at once; a running one is told through control and ends
`cancelled` whatever its handler's outcome (requeue, release); a cancel beats a reclaim."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from leasework import ConfigError
from leasework.leases import lease

from ...conftest import get_run
from ..checks import (
    TENANTS,
    cancel_beats_reclaim,
    claim_one,
    make_app,
)

Conn = psycopg.Connection[Any]


def test_cancel_of_a_queued_run_is_immediate(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    assert app.cancel(conn, run_id) == "cancelled"
    row = get_run(conn, run_id)
    assert row["status"] == "cancelled" and row["finished_at"] is not None
    assert claim_one(conn) is None
    assert app.cancel(conn, run_id) == "cancelled"  # idempotent, unchanged
    with pytest.raises(ConfigError, match="no run"):
        app.cancel(conn, 999_999)


def test_cancel_of_a_running_run_is_seen_by_control(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    assert lease.control(conn, claim) == "ok"
    assert app.cancel(conn, run_id) == "running"
    row = get_run(conn, run_id)
    assert row["status"] == "running" and row["cancel_requested_at"] is not None
    assert lease.control(conn, claim) == "cancelled"
    assert lease.finish(conn, claim, "cancelled", result={"partial": 1}, error="cancelled")
    row = get_run(conn, run_id)
    assert row["status"] == "cancelled" and row["result"] == {"partial": 1}
    assert app.cancel(conn, run_id) == "cancelled"


@pytest.mark.parametrize("tenant", TENANTS)
def test_cancel_beats_reclaim(conn: Conn, tenant: str | None) -> None:
    cancel_beats_reclaim(conn, tenant)


def test_requeue_after_cancel_request_ends_cancelled(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    app.cancel(conn, run_id)
    assert lease.requeue(conn, claim, delay=5, error="boom") == "cancelled"
    row = get_run(conn, run_id)
    assert row["status"] == "cancelled" and row["finished_at"] is not None


def test_release_after_cancel_request_ends_cancelled(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    app.cancel(conn, run_id)
    assert lease.release(conn, claim) == "cancelled"
    assert get_run(conn, run_id)["status"] == "cancelled"


def test_cancel_of_a_waiting_run_is_immediate(conn: Conn) -> None:
    app = make_app()
    app.enqueue(conn, "job", key="k")
    waiting = app.enqueue(conn, "other", key="k", exclusive=True)
    assert app.cancel(conn, waiting) == "cancelled"
    assert get_run(conn, waiting)["status"] == "cancelled"
