"""Shared bits of the benchmark scripts: a private database per script, medians and ranges, and
one table format, and the results channel (`--results FILE`: one JSON object per figure, read by
bench/summary.py). Benchmarks print figures; none of them asserts a timing. Only the standard
library and psycopg here: bench/peers.py imports this in the peers' virtualenv."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


def bench_database(admin_dsn: str, name: str) -> str:
    """(Re)create database `name` on the server of `admin_dsn`; returns its DSN."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return psycopg.conninfo.make_conninfo(admin_dsn, dbname=name)


def drop_database(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def med(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float], fmt: str = ",.0f") -> str:
    return f"{format(min(values), fmt)}-{format(max(values), fmt)}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A plain-text table, first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    for j, row in enumerate([headers, *rows]):
        cells = [
            str(c).ljust(widths[i]) if i == 0 else str(c).rjust(widths[i])
            for i, c in enumerate(row)
        ]
        print("  ".join(cells).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def results_arg(ap: argparse.ArgumentParser) -> None:
    """--results FILE, default $LEASEWORK_BENCH_RESULTS (unset or empty: no results file)."""
    ap.add_argument(
        "--results",
        metavar="FILE",
        default=os.environ.get("LEASEWORK_BENCH_RESULTS") or None,
        help="append one JSON line per figure to FILE (default: $LEASEWORK_BENCH_RESULTS)",
    )


def record(
    results: str | None,
    target: int,
    label: str,
    value: float,
    unit: str,
    *,
    baseline: float | None = None,
    baseline_label: str = "",
    ratio: float | None = None,
    target_text: str = "",
    met: bool | None = None,
    notes: str = "",
    short: bool = False,
) -> None:
    """Append one figure to `results` (nothing when None). `target` is issue 7's target number,
    `baseline` the raw loop's or the peer's figure from the same invocation, `met` None where no
    verdict applies, `short` True for a reduced size (--quick, or a short version of a target)."""
    if not results:
        return
    row: dict[str, Any] = {
        "script": os.path.basename(sys.argv[0]),
        "target": target,
        "label": label,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "baseline_label": baseline_label,
        "ratio": ratio,
        "target_text": target_text,
        "met": met,
        "notes": notes,
        "short": short,
    }
    with open(results, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")


# The raw queue: the ceiling leasework's figures are compared with, one table and the plainest
# loop on it (throughput.py, pickup_latency.py, bulk_enqueue.py, peers.py). Claim: the first
# queued row, FOR UPDATE SKIP LOCKED, a fresh owner token, a lease and the start time (as
# leasework's claim stamps them); finish: owner-scoped, one statement each, autocommit.
RAW_TABLE = "bench_raw_jobs"
RAW_SCHEMA = """
DROP TABLE IF EXISTS bench_raw_jobs;
CREATE TABLE bench_raw_jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    status text NOT NULL DEFAULT 'queued',
    payload jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    started_at timestamptz,
    lease_owner uuid,
    lease_expires_at timestamptz
);
CREATE INDEX ON bench_raw_jobs (id) WHERE status = 'queued';
"""
RAW_CLAIM = """
UPDATE bench_raw_jobs SET status = 'running', lease_owner = gen_random_uuid(),
       lease_expires_at = now() + interval '120 seconds', started_at = now()
 WHERE id = (SELECT id FROM bench_raw_jobs WHERE status = 'queued'
              ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id, lease_owner, payload
"""
RAW_DONE = "UPDATE bench_raw_jobs SET status = 'done' WHERE id = %s AND lease_owner = %s"
# Batched: claim N in one statement, complete them in one (owner-scoped per row).
RAW_CLAIM_MANY = """
UPDATE bench_raw_jobs SET status = 'running', lease_owner = gen_random_uuid(),
       lease_expires_at = now() + interval '120 seconds', started_at = now()
 WHERE id = ANY(ARRAY(SELECT id FROM bench_raw_jobs WHERE status = 'queued'
                       ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED))
RETURNING id, lease_owner, payload
"""
RAW_DONE_MANY = """
UPDATE bench_raw_jobs j SET status = 'done'
  FROM unnest(%s::bigint[], %s::uuid[]) AS d(id, owner)
 WHERE j.id = d.id AND j.lease_owner = d.owner
"""
# Jobs the raw loops have not finished (peers.py checks every queue drained).
RAW_LEFT = "SELECT count(*) FROM bench_raw_jobs WHERE status <> 'done'"


def raw_table(conn: psycopg.Connection[Any]) -> None:
    """(Re)create the raw queue's table, empty."""
    conn.execute(RAW_SCHEMA)


def raw_setup(dsn: str, jobs: int, tenants: int = 0) -> None:
    """The raw table with `jobs` queued no-op rows, analyzed (`tenants` is ignored: the raw
    queue has none; the argument matches the other systems' set-up)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        raw_table(conn)
        conn.execute(
            "INSERT INTO bench_raw_jobs (payload) SELECT '{}' FROM generate_series(1, %s)", (jobs,)
        )
        conn.execute("VACUUM ANALYZE bench_raw_jobs")


def raw_drain(conn: psycopg.Connection[Any]) -> int:
    """Claim and finish queued rows one at a time until none is left; how many."""
    done = 0
    while (row := conn.execute(RAW_CLAIM, prepare=True).fetchone()) is not None:
        conn.execute(RAW_DONE, (row[0], row[1]), prepare=True)
        done += 1
    return done


def raw_worker(dsn: str) -> None:
    """The raw loop, one job at a time, until the queue is empty."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        raw_drain(conn)


def raw_batch_worker(batch: int, dsn: str) -> None:
    """The raw loop, `batch` jobs per claim and per finish, until the queue is empty."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            rows = conn.execute(RAW_CLAIM_MANY, (batch,), prepare=True).fetchall()
            if not rows:
                return
            conn.execute(RAW_DONE_MANY, ([r[0] for r in rows], [r[1] for r in rows]), prepare=True)
