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
