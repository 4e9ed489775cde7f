"""What flow control costs the claim (issue 31, items 1 and 2): no-op jobs one at a time under
`leasework supervise` with its defaults (2 processes; throughput.py's `lw_supervised`, timed from
the first run's start to the last's finish), draining one kind with no limit, and the same
kind with a cap and a rate set high enough never to bind (`max_running` 1,000 and `rate`
1,000,000/1s: every claim of it locks the kind's row, counts its live leases, reads and writes
its window, and never goes through the quick statement), and each of the two alone. Rounds are
interleaved, the order reversed every other round (common.rounds); each ratio is the median of
the rounds' (common.paired) against the unlimited drain. Target ≥ 0.8. Beside them, in the same
rounds, the raw fused loop (the one-at-a-time limit) and the bare Worker loop with both limits
(a breakdown row: what the supervisor adds). Asserts nothing.

    .venv/bin/python bench/limits.py [--dsn DSN] [--jobs 10000] [--procs 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import psycopg
from common import (
    COST_HEADERS,
    DEFAULT_DSN,
    Run,
    bench_database,
    cost_cells,
    drop_database,
    med,
    paired,
    print_table,
    raw_fused_worker,
    raw_setup,
    record,
    results_arg,
    rounds,
    spread,
)
from throughput import RAW_FUSED, lw_setup, lw_supervised, lw_worker, timed

NONE = "no limit"
BOTH = "max_running 1000 + rate 1000000/1s"
CAP = "max_running 1000"
RATE = "rate 1000000/1s"
LIMITS = {
    NONE: None,
    BOTH: '{"max_running": 1000, "rate": [1000000, 1]}',
    CAP: '{"max_running": 1000}',
    RATE: '{"rate": [1000000, 1]}',
}
BARE = "bare Worker loop, max_running 1000 + rate 1000000/1s (breakdown)"


def set_limits(dsn: str, limits: str | None) -> None:
    """The kind's limits as an operator would set them (`leasework limits set`)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE leasework.kind_limits")
        if limits is not None:
            conn.execute(
                "INSERT INTO leasework.kind_limits (kind, overrides) VALUES ('noop', %s)",
                (limits,),
            )


def setup_with(limits: str | None) -> Callable[[str, int, int], None]:
    """throughput.lw_setup, then the kind's limits as an operator would set them."""

    def setup(dsn: str, jobs: int, tenants: int) -> None:
        lw_setup(dsn, jobs, tenants)
        set_limits(dsn, limits)

    return setup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="5,000 jobs, 3 repeats")
    results_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.repeat = min(args.jobs, 5000), min(args.repeat, 3)
    name = "leasework_bench_limits"
    dsn = bench_database(args.dsn, name)

    supervised = partial(lw_supervised, args.dsn)

    def one(label: str) -> Run:
        if label == RAW_FUSED:
            return timed(raw_setup, raw_fused_worker, dsn, args.jobs, args.procs)
        if label == BARE:
            return timed(setup_with(LIMITS[BOTH]), lw_worker, dsn, args.jobs, args.procs)
        lw_setup(dsn, 0, 0)  # the schema, before the limits go in
        set_limits(dsn, LIMITS[label])
        return supervised(dsn, args.jobs, args.procs)

    try:
        results = rounds([*LIMITS, RAW_FUSED, BARE], args.repeat, one)
    finally:
        drop_database(args.dsn, name)
    base = results[NONE]
    print(
        f"limits: {args.jobs:,} no-op jobs of one kind, `leasework supervise` with its defaults"
        f" ({args.procs} processes), {args.repeat} runs each, interleaved, beside the raw fused"
        " loop and the bare Worker loop; ratios: the median of each round's against the kind"
        " without limits"
    )
    rows = []
    for label, runs in results.items():
        values = [r.rate for r in runs]
        ratio = paired(runs, base)
        target = "≥ 0.80" if label == BOTH else ""
        rows.append(
            [label, f"{med(values):,.0f}", spread(values), f"{ratio:.2f}", target, *cost_cells(runs)]
        )
    print_table(["kind's limits", "jobs/s (median)", "range", "x none", "target", *COST_HEADERS], rows)
    both = [r.rate for r in results[BOTH]]
    ratio = paired(results[BOTH], base)
    record(
        args.results, 1, f"a capped and rated kind's drain ({args.jobs:,} jobs, {args.procs} procs,"
        f" {args.repeat} runs)", med(both), "jobs/s", baseline=med([r.rate for r in base]),
        baseline_label="the same kind without limits", ratio=ratio,
        target_text="≥ 0.80 x no limit", met=ratio >= 0.8, short=args.quick,
        notes=f"cap alone {paired(results[CAP], base):.2f}, rate alone"
        f" {paired(results[RATE], base):.2f}; ranges: limited {spread(both)}",
        issue=31,
    )  # fmt: skip


if __name__ == "__main__":
    main()
