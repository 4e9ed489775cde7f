"""Helpers for the connection sync and schedule tests: a files-connector directory, reading
records and runs back, and stub connectors standing in for an upstream API."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psycopg

from leasework import App
from leasework.syncs import Syncs
from leasework.syncs.kinds import connection_key
from leasework.workers.worker import Worker


def write_jsonl(directory: Path, table: str, rows: Iterable[dict[str, Any]]) -> None:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (directory / f"{table}.jsonl").write_text(text, encoding="utf-8")


def write_csv(directory: Path, table: str, header: list[str], rows: Iterable[list[Any]]) -> None:
    lines = [",".join(header)] + [",".join(str(v) for v in r) for r in rows]
    (directory / f"{table}.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")


def records(
    conn: psycopg.Connection[Any], connection_id: int
) -> dict[tuple[str, str], dict[str, Any]]:
    """{(table, external id): row} of one connection, tombstoned rows included."""
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        rows = cur.execute(
            "SELECT * FROM leasework.records WHERE connection_id = %s", (connection_id,)
        ).fetchall()
    return {(r["table_name"], r["external_id"]): r for r in rows}


def live(conn: psycopg.Connection[Any], connection_id: int) -> set[tuple[str, str]]:
    return {k for k, r in records(conn, connection_id).items() if r["deleted_at"] is None}


def tombstoned(conn: psycopg.Connection[Any], connection_id: int) -> set[tuple[str, str]]:
    return {k for k, r in records(conn, connection_id).items() if r["deleted_at"] is not None}


def runs_of(
    conn: psycopg.Connection[Any], connection_id: int, kind: str | None = None
) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute(
            "SELECT * FROM leasework.runs WHERE key = %s AND (%s::text IS NULL OR kind = %s) ORDER BY id",
            (connection_key(connection_id), kind, kind),
        ).fetchall()


def connection_row(conn: psycopg.Connection[Any], connection_id: int) -> dict[str, Any] | None:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute(
            "SELECT * FROM leasework.connections WHERE id = %s", (connection_id,)
        ).fetchone()


def poll_until(workers: list[Worker], done: Callable[[], bool], *, timeout: float = 20.0) -> None:
    """Each worker polls in its own thread until `done()` holds (checked between polls)."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop(w: Worker) -> None:
        try:
            while not stop.is_set():
                if w.poll() == 0:
                    time.sleep(0.01)
        except BaseException as exc:  # surfaced in the test's thread
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        while not done():
            if errors or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    if errors:
        raise errors[0]
    assert done(), f"condition not met within {timeout} s"


def rows(n: int, prefix: str = "r", start: int = 1) -> Iterator[dict[str, Any]]:
    for i in range(start, start + n):
        yield {"id": f"{prefix}{i}", "n": i}


def sync_app() -> App:
    """An app that uses the connection-sync family."""
    app = App()
    app.use(Syncs())
    return app


def syncs(app: App) -> Syncs:
    """The sync family's API of an app that uses it."""
    family = app.family(Syncs)
    assert family is not None, "the app does not use Syncs"
    return family
