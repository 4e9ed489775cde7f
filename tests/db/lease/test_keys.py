"""Keys: one active run per key; an exclusive run waits until its key is idle, then is promoted;
a key is free again once its run ends."""

from __future__ import annotations

from typing import Any

import psycopg

from leasework.workers import lease

from ...conftest import get_run
from ..checks import (
    claim_one,
    make_app,
    waiting_run_waits_for_its_key,
)

Conn = psycopg.Connection[Any]


def test_waiting_exclusive_run_is_promoted_only_when_its_key_is_idle(conn: Conn) -> None:
    waiting_run_waits_for_its_key(conn)


def test_exclusive_run_on_an_idle_key_is_queued_at_once(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "other", key="k", exclusive=True)
    assert get_run(conn, run_id)["status"] == "queued"


def test_key_is_free_again_after_the_run_ends(conn: Conn) -> None:
    app = make_app()
    first = app.enqueue(conn, "job", key="k")
    claim = claim_one(conn)
    assert claim is not None
    assert lease.finish(conn, claim, "failed", error="x")
    second = app.enqueue(conn, "job", key="k")
    assert second != first
