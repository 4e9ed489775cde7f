"""Rows of the workers table: who is alive (heartbeat) and what it is running. Written by a
standalone worker for itself, or by the supervisor for its children."""

from __future__ import annotations

from typing import Any

import psycopg

from ..config import Config
from ..queries import load

Q = load("leasework.workers", "presence.sql")


# A worker's pool as its row records it: (name, kinds); kinds None is the pool that takes every
# kind no other pool of its host names. (None, None): no pool, every kind.
PoolRow = tuple[str | None, list[str] | None]


def pool_of(config: Config, pool: str | None) -> PoolRow:
    if pool is None:
        return None, None
    kinds = config.pool(pool).kinds
    return pool, None if kinds is None else list(kinds)


def upsert_worker(
    conn: psycopg.Connection[Any],
    worker_id: str,
    host: str,
    pid: int,
    current_run: int | None,
    pool: PoolRow = (None, None),
) -> None:
    conn.execute(
        Q["upsert_worker"],
        {
            "id": worker_id,
            "host": host,
            "pid": pid,
            "current_run": current_run,
            "pool": pool[0],
            "pool_kinds": pool[1],
        },
        prepare=True,
    )


def stop_worker(conn: psycopg.Connection[Any], worker_id: str) -> None:
    conn.execute(Q["stop_worker"], {"id": worker_id})


def remove_worker(conn: psycopg.Connection[Any], worker_id: str) -> None:
    conn.execute(Q["remove_worker"], {"id": worker_id})
