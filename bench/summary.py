"""One table of issue 7's eight targets from the figures the bench scripts appended to a results
file (`--results FILE`, or $LEASEWORK_BENCH_RESULTS; `make bench` and `make bench-long` set one):
each figure next to its baseline or peer from the same invocation, the ratio, the target and the
verdict; then, when bench/async_io.py ran, one of issue 16's (async handlers), and when
bench/backlog.py ran, one of issue 29's (work the claim cannot take). A target whose
script did not run in this invocation gets a row naming the command that measures it. Standard library only; asserts nothing (exit status 0 whatever the verdicts).

    python3 bench/summary.py FILE [FILE ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# (target, script, target text, command that measures it): the rows expected, in order.
EXPECTED: list[tuple[int, str, str, str]] = [
    # 1-3: `leasework supervise` with its defaults (issue 30); the bare loops are breakdown rows.
    (1, "throughput.py", "≥ 0.80 x raw fused", "make bench"),
    (1, "peers.py", "≥ 0.80 x raw fused", "make bench (bench/peers.sh)"),
    (2, "throughput.py", "≥ 0.60 x raw batched", "make bench"),
    (2, "peers.py", "≥ 0.60 x raw batched, ≥ 1.50 x PGQueuer", "make bench (bench/peers.sh)"),
    (3, "pickup_latency.py", "p50 ≤ 1.2 x, p95 ≤ 2.0 x raw", "make bench"),
    (4, "claim_flatness.py", "≥ 0.80 x / ≥ 0.50 x empty", "make bench"),
    (5, "peers.py", "≥ 1.0 x PGQueuer", "make bench (bench/peers.sh)"),
    (5, "bulk_enqueue.py", "context", "make bench"),
    (6, "recovery.py", "≤ 1 s (vs ≈ lease)", "make bench"),
    (7, "recovery.py", "≤ 60 MB (57.2 MiB)", "make bench"),
    (7, "ingest_large.py", "1 GB: ≤ 150 MB, ≤ 200 redone", "make bench-long"),
    (8, "bloat.py", "≤ documented bound", "make bench-long (~11 min)"),
]

# Issue 16 (async handlers), all from bench/async_io.py (run by bench/peers.sh in the peers'
# virtualenv): IO-bound runs, 2 processes x concurrency 10, against each peer and the ideal
# (2 x 10 / 0.05 s = 400 runs/s); no-op async against sync one at a time; a child's RSS at rest.
ISSUE_16_SCRIPT = "async_io.py"
ISSUE_16_COMMAND = "make bench (bench/peers.sh async_io.py)"
EXPECTED_16: list[tuple[int, str, str, str]] = [
    (1, ISSUE_16_SCRIPT, "≥ 1.0 x Procrastinate", ISSUE_16_COMMAND),
    (2, ISSUE_16_SCRIPT, "≥ 1.0 x PGQueuer", ISSUE_16_COMMAND),
    (3, ISSUE_16_SCRIPT, "≥ 0.80 x ideal (400/s)", ISSUE_16_COMMAND),
    (4, ISSUE_16_SCRIPT, "≥ 0.80 x sync one at a time", ISSUE_16_COMMAND),
    (5, ISSUE_16_SCRIPT, "≤ 40 MiB", ISSUE_16_COMMAND),
]

# Issue 29 (a claim that costs the same whatever it cannot take), all from bench/backlog.py: (a)-(e)
# each against the same drain with no backlog; (f), the held snapshot on a private cluster, only
# in `make bench-long`; the fairness case in claims.
ISSUE_29_SCRIPT = "backlog.py"
EXPECTED_29: list[tuple[int, str, str, str]] = [
    (1, ISSUE_29_SCRIPT, "(a)-(e), (g) each ≥ 0.80 x no backlog", "make bench"),
    (2, ISSUE_29_SCRIPT, "≥ 0.9 x offered, drained ≤ 30 s after", "make bench-long"),
    (3, ISSUE_29_SCRIPT, "each small run ≤ 100 claims", "make bench"),
]


def num(v: float) -> str:
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def verdict(r: dict[str, Any]) -> str:
    met = r.get("met")
    text = "no verdict" if met is None else "met" if met else "NOT MET"
    return text + (" *" if r.get("short") else "")


def load(paths: list[str]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    rows: list[dict[str, Any]] = []
    failed: dict[str, int] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        except FileNotFoundError:
            print(f"summary: {path}: no such file (no script recorded a figure)", file=sys.stderr)
            continue
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                print(f"summary: {path}:{n}: not JSON, skipped", file=sys.stderr)
                continue
            if "failed" in obj:  # written by the Makefile when a script exits non-zero
                failed[obj["script"]] = int(obj["failed"])
            else:
                rows.append(obj)
    return rows, failed


def table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    right = {3, 4, 5}  # the figures
    for j, row in enumerate([headers, *rows]):
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def rows_for(
    issue: int,
    expected: list[tuple[int, str, str, str]],
    records: list[dict[str, Any]],
    failed: dict[str, int],
    notes: list[str],
) -> list[list[str]]:
    """One issue's table rows, in the order of `expected`; its notes appended to `notes`."""
    out: list[list[str]] = []
    shown: set[int] = set()
    for target, script, target_text, command in expected:
        mine = [
            r
            for r in records
            if r.get("issue", 7) == issue
            and r.get("target") == target
            and r.get("script") == script
        ]
        num_cell = "" if target in shown else str(target)
        shown.add(target)
        for r in mine:
            base = r.get("baseline")
            base_cell = "" if base is None else f"{num(base)} ({r.get('baseline_label', '')})"
            if r.get("skipped"):  # the script ran, leasework's figure could not be measured
                out.append(
                    [num_cell, script, f"{r.get('label', '')}: skipped (see notes)",
                     "", base_cell, "", r.get("target_text") or target_text, "not run"]
                )  # fmt: skip
                why = f"{script} skipped leasework's figures: {r['skipped']}"
                if why not in notes:
                    notes.append(why)
                num_cell = ""
                continue
            unit = r.get("unit", "")
            ratio = r.get("ratio")
            out.append(
                [num_cell, script, r.get("label", ""), f"{num(r['value'])} {unit}", base_cell,
                 "" if ratio is None else f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.3f}", r.get("target_text", ""), verdict(r)]
            )  # fmt: skip
            num_cell = ""
            if r.get("notes"):
                prefix = str(target) if issue == 7 else f"{issue}.{target}"
                notes.append(f"{prefix} {script}, {r.get('label', '')}: {r['notes']}")
        if script in failed and not mine:
            out.append(
                [num_cell, script, f"FAILED (exit {failed[script]}): {command}",
                 "", "", "", target_text, "not run"]
            )  # fmt: skip
        elif not mine:
            out.append(
                [num_cell, script, f"not run here: {command}",
                 "", "", "", target_text, "not run"]
            )  # fmt: skip
        elif script == "ingest_large.py" and all(r.get("short") for r in mine):
            out.append(
                ["", script, f"1 GB file not run here: {command}",
                 "", "", "", target_text, "not run"]
            )  # fmt: skip
    return out


HEADERS = ["#", "script", "figure", "leasework", "baseline / peer (same run)", "ratio", "target",
           "verdict"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", metavar="FILE")
    args = ap.parse_args()
    records, failed = load(args.files)

    notes: list[str] = []
    out = rows_for(7, EXPECTED, records, failed, notes)
    known = (
        {(7, t, s) for t, s, _, _ in EXPECTED}
        | {(16, t, s) for t, s, _, _ in EXPECTED_16}
        | {(29, t, s) for t, s, _, _ in EXPECTED_29}
    )
    for r in records:  # figures from a script or target these tables do not list
        if (r.get("issue", 7), r.get("target"), r.get("script")) not in known:
            notes.append(f"unlisted: {json.dumps(r, ensure_ascii=False)}")

    print("issue 7 targets: every figure beside its baseline or peer from the same invocation")
    table(HEADERS, out)
    # Issue 16's table when its script ran (or failed) in this invocation: `make bench`, not
    # `make bench-long`.
    if any(r.get("issue") == 16 for r in records) or ISSUE_16_SCRIPT in failed:
        print("\nissue 16 targets (async handlers): same invocation, same server")
        table(HEADERS, rows_for(16, EXPECTED_16, records, failed, notes))
    # Issue 29's when bench/backlog.py ran (or failed) in this invocation.
    if any(r.get("issue") == 29 for r in records) or ISSUE_29_SCRIPT in failed:
        print("\nissue 29 targets (work the claim cannot take): same invocation, same server")
        table(HEADERS, rows_for(29, EXPECTED_29, records, failed, notes))
    if any(r.get("short") for r in records):
        print(
            "* reduced size (--quick, or a short version of the target's run): a figure under"
            " other conditions than the target's"
        )
    for script, status in failed.items():
        print(f"{script} exited with status {status}: its figures after the failure are missing")
    if notes:
        print("\nnotes:")
        for n in notes:
            print(f"  {n}")


if __name__ == "__main__":
    main()
