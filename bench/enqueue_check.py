"""What leasework.enqueue's payload check costs (migration 0029): the same enqueues with the
function as it was before the check (0026's body, put back in a database of its own) and as it is
now, for a kind no worker declared (one primary-key look-up more), a kind declared to take any
JSON, and one whose handler takes keywords (the payload checked). Two paths: N enqueues in one
statement (the function's own cost, no round trips) and N `app.enqueue` calls in one transaction
(Python's path, each a round trip). Repeats interleaved; prints medians and ranges in
microseconds per enqueue; asserts nothing.

    .venv/bin/python bench/enqueue_check.py [--dsn DSN] [--enqueues 5000] [--repeat 5] [--quick]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import psycopg
from common import DEFAULT_DSN, bench_database, drop_database, med, print_table, spread
from psycopg.types.json import Jsonb

from leasework import App, db

ROOT = Path(__file__).resolve().parents[1]

bench_app = App()


# One handler for every kind, so that Python's own check is the same in every case: what differs
# is what the database holds for the kind (nothing, "any", or the handler's keywords).
def handler(ctx: Any, *, week: int, fmt: str = "pdf") -> None: ...


for _kind in ("undeclared", "takes.any", "takes.keywords"):
    bench_app.task(_kind)(handler)


def function_text(path: Path, name: str = "leasework.enqueue(") -> str:
    """The CREATE OR REPLACE FUNCTION of `name` in a migration, whole."""
    text = path.read_text()
    start = text.index(f"CREATE OR REPLACE FUNCTION {name}")
    return text[start : text.index("\n$$;\n", start) + 5]


BEFORE = function_text(ROOT / "leasework/migrations/0026_dependencies.sql")
AFTER = function_text(ROOT / "schema.sql")


def server_side(conn: psycopg.Connection[Any], kind: str, n: int) -> float:
    """Microseconds per enqueue, n of them in one statement."""
    with conn.transaction():
        start = time.perf_counter()
        conn.execute(
            "SELECT count(leasework.enqueue(%s, %s::jsonb)) FROM generate_series(1, %s)",
            (kind, Jsonb({"week": 48}), n),
        )
        took = time.perf_counter() - start
    return took / n * 1e6


def python_path(conn: psycopg.Connection[Any], kind: str, n: int) -> float:
    """Microseconds per `app.enqueue`, n of them in one transaction."""
    with conn.transaction():
        start = time.perf_counter()
        for _ in range(n):
            bench_app.enqueue(conn, kind, {"week": 48})
        took = time.perf_counter() - start
    return took / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--enqueues", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2,000 enqueues, 3 runs")
    args = ap.parse_args()
    if args.quick:
        args.enqueues, args.repeat = min(args.enqueues, 2000), min(args.repeat, 3)
    name = "leasework_bench_enqueue_check"
    dsn = bench_database(args.dsn, name)
    cases = [
        ("before the check (0026)", BEFORE, "undeclared"),
        ("kind not declared", AFTER, "undeclared"),
        ("declared: any JSON", AFTER, "takes.any"),
        ("declared: keywords, checked", AFTER, "takes.keywords"),
    ]
    paths = {"one statement": server_side, "app.enqueue": python_path}
    res: dict[tuple[str, str], list[float]] = {(c[0], p): [] for c in cases for p in paths}
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            db.migrate(conn)
            conn.execute(
                "INSERT INTO leasework.kinds (kind, accepts) VALUES (%s, %s), (%s, %s)",
                (
                    "takes.any",
                    Jsonb({"takes": "any"}),
                    "takes.keywords",
                    Jsonb(bench_app.tasks["takes.keywords"].accepts.declared()),
                ),
            )
            for _ in range(args.repeat):
                for label, body, kind in cases:
                    conn.execute(body)
                    for path, fn in paths.items():
                        conn.execute("TRUNCATE leasework.runs")
                        fn(conn, kind, args.enqueues // 5)  # warm: plans, caches
                        conn.execute("TRUNCATE leasework.runs")
                        res[(label, path)].append(fn(conn, kind, args.enqueues))
    finally:
        drop_database(args.dsn, name)
    print(
        f"leasework.enqueue's payload check: {args.enqueues:,} enqueues per run, {args.repeat} "
        "runs each, microseconds per enqueue"
    )
    rows = []
    for label, _, _ in cases:
        cells = [label]
        for path in paths:
            v = res[(label, path)]
            base = med(res[(cases[0][0], path)])
            cells += [f"{med(v):.1f}", spread(v, ".1f"), f"{med(v) - base:+.1f}"]
        rows.append(cells)
    headers = ["case"]
    for path in paths:
        headers += [f"{path} (median)", "range", "vs before"]
    print_table(headers, rows)
    accepts = bench_app.tasks["takes.keywords"].accepts
    payload = {"week": 48}
    n = 100_000
    start = time.perf_counter()
    for _ in range(n):
        accepts.check("takes.keywords", payload)
    print(
        f"Python's own check (Accepts.check, in every app.enqueue above): "
        f"{(time.perf_counter() - start) / n * 1e6:.2f} microseconds per payload"
    )


if __name__ == "__main__":
    main()
