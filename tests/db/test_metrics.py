"""/metrics, second round (docs/operations.md, "Metrics"): every ended attempt by kind and outcome, the
queue-wait histogram, live workers by pool, counters that survive pruning and retries, and a
scrape whose size is bounded however many kinds there are (max_kinds_shown: the rest under
kind="other"; the dashboard's tables and `leasework status` too)."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from leasework import operations, status
from leasework.dashboard.web import DashboardApp
from leasework.workers import presence

from ..conftest import fast_config

Conn = psycopg.Connection[Any]
PROMTOOL = shutil.which("promtool")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(dsn: str, **overrides: Any) -> tuple[bytes, Samples]:
    body = DashboardApp(fast_config(dsn, **overrides)).metrics()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
    }
    return body, samples


def metric(samples: Samples) -> Callable[..., float]:
    def get(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    return get


def entry(outcome: str) -> str:
    return (
        '{"attempt": 1, "owner": null, "worker": "w", "started_at": "2026-01-01T00:00:00+00:00",'
        f' "ended_at": "2026-01-01T00:00:01+00:00", "outcome": "{outcome}", "error": "x"}}'
    )


def history(*outcomes: str) -> str:
    return "[" + ", ".join(entry(o) for o in outcomes) + "]"


def insert_runs(conn: Conn) -> dict[str, int]:
    """Runs of kind `mail` in each shape an attempt can end in, with known waits and durations:
    two succeeded (one after a failed and a timed-out attempt), one failed (after a Retry), one
    cancelled, one queued again (after a lost, a released and a snoozed attempt)."""
    ids: dict[str, int] = {}
    rows = [
        ("ok", "succeeded", "[]", 3, 1),
        ("ok_after_two", "succeeded", history("failed", "timeout"), 20, 2),
        ("failed", "failed", history("retry", "failed"), 0.02, 400),
        ("cancelled", "cancelled", history("cancelled"), 7000, 0.3),
    ]
    for name, st, hist, waited, took in rows:
        row = conn.execute(
            "INSERT INTO leasework.runs (kind, status, history, attempts, queued_at, started_at,"
            " finished_at) VALUES ('mail', %s, %s::jsonb, 1,"
            " now() - make_interval(secs => %s + %s + 5), now() - make_interval(secs => %s + 5),"
            " now() - interval '5 seconds') RETURNING id",
            (st, hist, waited, took, took),
        ).fetchone()
        assert row is not None
        ids[name] = row[0]
    row = conn.execute(
        "INSERT INTO leasework.runs (kind, history, attempts) VALUES"
        " ('mail', %s::jsonb, 1) RETURNING id",
        (history("expired", "released", "snoozed"),),
    ).fetchone()
    assert row is not None
    ids["queued"] = row[0]
    return ids


EXPECTED_ATTEMPTS = {
    "succeeded": 2,
    "failed": 2,
    "retried": 1,
    "timed_out": 1,
    "cancelled": 1,
    "released": 1,
    "snoozed": 1,
    "lost": 1,
}


def check_mail(samples: Samples) -> None:
    get = metric(samples)
    for outcome, n in EXPECTED_ATTEMPTS.items():
        assert get("leasework_attempts_total", kind="mail", outcome=outcome) == n, outcome
    # Waits of 0.02 s, 3 s, 20 s and 7000 s: cumulative buckets, the sum, the count.
    wait = {le: get("leasework_queue_wait_seconds_bucket", kind="mail", le=le)
            for le in ("0.05", "5", "60", "3600", "10800", "+Inf")}  # fmt: skip
    assert wait == {"0.05": 1, "5": 2, "60": 3, "3600": 3, "10800": 4, "+Inf": 4}
    assert get("leasework_queue_wait_seconds_count", kind="mail") == 4
    assert 7023 - 1 <= get("leasework_queue_wait_seconds_sum", kind="mail") <= 7023 + 1
    assert get("leasework_run_duration_seconds_count", kind="mail") == 4


def test_attempts_and_queue_wait_by_kind_survive_pruning_and_retries(dsn: str, conn: Conn) -> None:
    ids = insert_runs(conn)
    _, samples = scrape(dsn)
    check_mail(samples)

    # Pruned (any DELETE): the counts move to leasework.counters, nothing goes down.
    conn.execute(
        "DELETE FROM leasework.runs WHERE id = ANY(%s)", ([ids["ok"], ids["ok_after_two"]],)
    )
    _, samples = scrape(dsn)
    check_mail(samples)
    # Retried by an operator: the history stays with the row, the finish and its wait move.
    operations.retry(conn, [ids["failed"], ids["cancelled"]])
    _, samples = scrape(dsn)
    check_mail(samples)
    assert metric(samples)("leasework_runs_finished_total", kind="mail", outcome="failed") == 1
    # And the retried runs pruned in turn: still the same.
    conn.execute("DELETE FROM leasework.runs")
    _, samples = scrape(dsn)
    check_mail(samples)


def test_debounce_merges_are_counted(dsn: str, conn: Conn) -> None:
    for _ in range(4):  # one run, three merges
        conn.execute("SELECT leasework.enqueue('digest', key => 'u1', debounce => 60)")
    conn.execute("SELECT leasework.enqueue('digest', key => 'u2', debounce => 60)")
    assert metric(scrape(dsn)[1])("leasework_debounced_total", kind="digest") == 3
    conn.execute("DELETE FROM leasework.runs")  # pruned: kept
    assert metric(scrape(dsn)[1])("leasework_debounced_total", kind="digest") == 3


def test_live_workers_by_pool(dsn: str, conn: Conn) -> None:
    (run,) = conn.execute("INSERT INTO leasework.runs (kind) VALUES ('x') RETURNING id").fetchone()
    presence.upsert_worker(conn, "w1", "h", 1, None, ("reports", ["report"]))
    presence.upsert_worker(conn, "w2", "h", 2, run, ("reports", ["report"]))
    presence.upsert_worker(conn, "w3", "h", 3, None)
    presence.upsert_worker(conn, "w4", "h", 4, None, ("reports", ["report"]))
    conn.execute("UPDATE leasework.workers SET stopped_at = now() WHERE id = 'w4'")
    get = metric(scrape(dsn)[1])
    assert get("leasework_pool_workers", pool="reports", state="busy") == 1
    assert get("leasework_pool_workers", pool="reports", state="idle") == 1
    assert get("leasework_pool_workers", pool="", state="idle") == 1
    assert get("leasework_pool_workers", pool="", state="busy") == 0


def test_kinds_past_the_setting_fold_into_other(dsn: str, conn: Conn) -> None:
    insert_runs(conn)
    conn.execute(
        "SELECT leasework.enqueue('busy', '{}') FROM generate_series(1, 3);"
        "SELECT leasework.enqueue('quiet', '{}');"
        "SELECT leasework.enqueue('other', '{}')"  # a kind named other is always summed there
    )
    _, samples = scrape(dsn, max_kinds_shown=2)
    get = metric(samples)
    kinds = {dict(k[1]).get("kind") for k in samples if k[0] == "leasework_runs"}
    assert kinds == {"mail", "busy", "other"}
    assert get("leasework_runs", kind="other", status="queued") == 2
    assert get("leasework_kinds", state="folded") == 2
    check_mail(samples)
    # Unbounded, every kind has its label (and `other` is the kind of that name).
    _, samples = scrape(dsn, max_kinds_shown=10)
    assert metric(samples)("leasework_runs", kind="other", status="queued") == 1
    assert metric(samples)("leasework_runs", kind="quiet", status="queued") == 1


@pytest.mark.skipif(PROMTOOL is None, reason="no promtool: `apt-get install -y prometheus`")
def test_twenty_thousand_kinds_stay_small(dsn: str, conn: Conn) -> None:
    """20,000 kinds enqueued through the enqueue function: /metrics under 200 KB and promtool
    clean, the overview and /kinds bounded, `leasework status` a screenful."""
    assert PROMTOOL is not None
    conn.execute(
        "SELECT leasework.enqueue('tenant-' || lpad(g::text, 5, '0') || '.nightly_report', '{}')"
        "  FROM generate_series(1, 20000) g"
    )
    insert_runs(conn)
    started = time.monotonic()
    body, samples = scrape(dsn)
    took = time.monotonic() - started
    print(f"/metrics with 20,000 kinds: {len(body):,} bytes in {took:.2f} s")
    assert len(body) < 200_000, len(body)
    get = metric(samples)
    assert get("leasework_kinds", state="folded") == 20001 - 30
    assert get("leasework_runs", kind="other", status="queued") == 20000 - 29
    check_mail(samples)
    check = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=120
    )
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr

    dash = DashboardApp(fast_config(dsn))
    started = time.monotonic()
    page = dash.overview()
    print(f"/ with 20,000 kinds: {len(page):,} bytes in {time.monotonic() - started:.2f} s")
    assert len(page) < 150_000, len(page)
    assert "(19,971 more kinds)" in page
    kinds_page = dash.kinds()
    assert len(kinds_page) < 150_000, len(kinds_page)
    assert "(19,971 more kinds)" in kinds_page
    snap = status.collect(conn, max_kinds=30)
    text = status.render(snap)
    assert len(text.splitlines()) < 120, len(text.splitlines())
    assert "other: 19,971 more kinds summed" in text
