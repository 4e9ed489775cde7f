"""The schema itself refuses a row whose status and lease columns disagree."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from ..checks import (
    make_app,
)

Conn = psycopg.Connection[Any]


def test_status_invariants_are_enforced_by_the_schema(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("UPDATE leasework.runs SET status = 'running' WHERE id = %s", (run_id,))
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("UPDATE leasework.runs SET status = 'succeeded' WHERE id = %s", (run_id,))
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("UPDATE leasework.runs SET status = 'done' WHERE id = %s", (run_id,))
