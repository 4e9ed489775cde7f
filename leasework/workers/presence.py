"""Rows of the workers table: who is alive (heartbeat) and what it is running. Written by a
standalone worker for itself, or by the supervisor for its children."""

from __future__ import annotations

from typing import Any

import psycopg

from ..queries import load

Q = load("leasework.workers", "presence.sql")


def upsert_worker(
    conn: psycopg.Connection[Any], worker_id: str, host: str, pid: int, current_run: int | None
) -> None:
    conn.execute(
        Q["upsert_worker"],
        {"id": worker_id, "host": host, "pid": pid, "current_run": current_run},
        prepare=True,
    )


def stop_worker(conn: psycopg.Connection[Any], worker_id: str) -> None:
    conn.execute(Q["stop_worker"], {"id": worker_id})


def remove_worker(conn: psycopg.Connection[Any], worker_id: str) -> None:
    conn.execute(Q["remove_worker"], {"id": worker_id})
