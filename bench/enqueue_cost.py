"""What one enqueue costs on the pickup-latency path (issue 30): `app.enqueue` of one run, each
in its own transaction (autocommit: a web request's enqueue and commit), N per round, rounds
interleaved between a run without tags, and with two tags when this leasework takes them; each
committed, and all of a round in one transaction (the statement alone, no flush); and the SQL
function alone, N calls in one statement in the server (no client, no round trip). Run it
from two checkouts (PYTHONPATH) to compare releases: it uses only the public API, and migrates a
database of its own with the schema of the leasework it imports. Prints medians; asserts nothing.

    PYTHONPATH=. .venv/bin/python bench/enqueue_cost.py [--dsn DSN] [--n 2000] [--rounds 7]
    PYTHONPATH=. .venv/bin/python bench/enqueue_cost.py --against ../main/schema.sql --n 5000
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Any

import psycopg
from common import DEFAULT_DSN, bench_database, drop_database, med, print_table, spread

from leasework import App, db
from leasework.tasks import EnqueueOptions

ENQUEUE_SQL = (
    "SELECT count(leasework.enqueue('noop', jsonb_build_object('i', g){tags})) "
    "FROM generate_series(1, %(n)s) AS g"
)


class Rollback(Exception):
    pass


app = App()
app.task("noop")(lambda ctx, payload: None)


def round_of(
    conn: psycopg.Connection[Any], n: int, options: EnqueueOptions, together: bool = False
) -> float:
    """Microseconds per enqueue, over n enqueues: each committed (autocommit), or `together` in
    one transaction (the statement's own cost, without a commit's flush)."""
    t = time.perf_counter()
    if together:
        with conn.transaction():
            for i in range(n):
                app.enqueue(conn, "noop", {"i": i}, **options)
    else:
        for i in range(n):
            app.enqueue(conn, "noop", {"i": i}, **options)
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN (a database is made)")
    ap.add_argument("--n", type=int, default=2000, help="enqueues per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--against",
        metavar="SCHEMA_SQL",
        help="another release's schema.sql: only the SQL function, this one's and that one's "
        "interleaved round by round in two databases of the same server",
    )
    args = ap.parse_args()
    if args.against:
        against(args)
        return
    variants: dict[str, EnqueueOptions] = {"no tags": {}}
    if "tags" in EnqueueOptions.__optional_keys__:
        variants["two tags"] = {"tags": ["import", "batch-7"]}  # type: ignore[typeddict-item]
    sql_variants = {
        "SQL leasework.enqueue, no tags": ENQUEUE_SQL.format(tags=""),
    }
    if "two tags" in variants:
        sql_variants["SQL leasework.enqueue, two tags"] = ENQUEUE_SQL.format(
            tags=", tags => array['import', 'batch-7']"
        )
    name = "leasework_bench_enqueue_cost"
    dsn = bench_database(args.dsn, name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            db.migrate(conn)
            for options in variants.values():  # warm up: plans, caches
                round_of(conn, 200, options)
            times: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                for label, options in variants.items():
                    for together in (False, True):
                        name_ = f"{label}, {'one transaction' if together else 'each committed'}"
                        times.setdefault(name_, []).append(
                            round_of(conn, args.n, options, together)
                        )
                conn.execute("TRUNCATE leasework.runs")
                # The function alone, in the server: n calls in one statement, rolled back.
                for label, call in sql_variants.items():
                    with contextlib.suppress(Rollback), conn.transaction():
                        t = time.perf_counter()
                        conn.execute(call, {"n": args.n})
                        times.setdefault(label, []).append(
                            (time.perf_counter() - t) / args.n * 1e6
                        )
                        raise Rollback
            version = db.SCHEMA_VERSION
    finally:
        drop_database(args.dsn, name)
    print(f"schema version {version}: {args.rounds} rounds of {args.n:,} enqueues each")
    print_table(
        ["enqueue", "us per enqueue (median)", "range"],
        [[k, f"{med(v):,.1f}", spread(v, ",.1f")] for k, v in times.items()],
    )


def against(args: argparse.Namespace) -> None:
    """leasework.enqueue without tags, n calls in one statement (rolled back), in a database of
    this schema and one of `args.against`, alternating which goes first each round."""
    here = Path(__file__).resolve().parents[1] / "schema.sql"
    schemas = {"this schema.sql": here, f"{args.against}": Path(args.against)}
    names = {label: f"leasework_bench_cost_{i}" for i, label in enumerate(schemas)}
    conns = {}
    try:
        for label, path in schemas.items():
            conn = psycopg.connect(bench_database(args.dsn, names[label]), autocommit=True)
            conn.execute(path.read_text(encoding="utf-8").encode())
            conns[label] = conn
        call = ENQUEUE_SQL.format(tags="")
        times: dict[str, list[float]] = {label: [] for label in conns}
        for r in range(args.rounds * 2 + 1):
            order = list(conns.items()) if r % 2 else list(reversed(conns.items()))
            for label, conn in order:
                with contextlib.suppress(Rollback), conn.transaction():
                    t = time.perf_counter()
                    conn.execute(call, {"n": args.n})
                    if r:  # the first round warms up
                        times[label].append((time.perf_counter() - t) / args.n * 1e6)
                    raise Rollback
    finally:
        for conn in conns.values():
            conn.close()
        for name in names.values():
            drop_database(args.dsn, name)
    print(f"leasework.enqueue without tags, {args.n:,} calls per statement, interleaved:")
    print_table(
        ["schema", "us per call (median)", "range"],
        [[k, f"{med(v):,.1f}", spread(v, ",.1f")] for k, v in times.items()],
    )


if __name__ == "__main__":
    main()
