"""`/metrics`: Prometheus text format, computed from the database at each scrape (prometheus-client
metric families). Counters are durable: the runs in the table plus what runs that left it handed
over to leasework.counters (schema.sql), so they only go up, survive restarts, and every dashboard
process (on any host) reports the same figures. Only reads."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from psycopg.rows import dict_row

from ..queries import load
from ..text import visible

Q = load("leasework.dashboard", "dashboard.sql")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATUSES = (
    "blocked",
    "waiting",
    "queued",
    "running",
    "succeeded",
    "partial",
    "failed",
    "cancelled",
)
OUTCOMES = ("succeeded", "partial", "failed", "cancelled")


def families(
    conn: psycopg.Connection[Any],
    snap: Mapping[str, Any],
    *,
    heartbeat_interval: float,
    version: str = "",
) -> list[Metric]:
    """Every metric family for one scrape. `snap` is `status.collect()`'s snapshot (runs by kind
    and status, the oldest due run per kind); the rest comes from dashboard.sql."""
    with conn.cursor(row_factory=dict_row) as cur:
        w = cur.execute(Q["metrics_workers"], {"stale": heartbeat_interval * 2}).fetchone() or {}
        counted = cur.execute(Q["metrics_counters"]).fetchall()
        row = cur.execute(Q["metrics_duration_buckets"]).fetchone()
    bounds = [float(b) for b in (row or {}).get("buckets") or []]
    by_kind: Mapping[str, Mapping[str, int]] = snap.get("runs_by_kind") or {}
    kinds = sorted(set(by_kind) | {str(r["kind"]) for r in counted})
    # A label value as every reader shows it: a kind stored before the kind rule held shows its
    # controls escaped (the exposition format escapes only backslash, quote and newline).
    shown = {kind: visible(kind) for kind in kinds}

    runs = GaugeMetricFamily(
        "leasework_runs", "Runs in the table by kind and status.", labels=["kind", "status"]
    )
    for kind in kinds:
        per = by_kind.get(kind, {})
        for status in STATUSES:
            runs.add_metric([shown[kind], status], per.get(status, 0))

    oldest_due: Mapping[str, float] = snap.get("oldest_due") or {}
    oldest = GaugeMetricFamily(
        "leasework_oldest_queued_age_seconds",
        "How long the oldest due queued run has waited (0 when none is waiting).",
        value=max([0.0, *(max(0.0, a) for a in oldest_due.values())]),
    )
    oldest_by_kind = GaugeMetricFamily(
        "leasework_kind_oldest_queued_age_seconds",
        "How long the oldest due queued run of each kind has waited (0 when none is waiting).",
        labels=["kind"],
    )
    for kind in kinds:
        oldest_by_kind.add_metric([shown[kind]], max(0.0, float(oldest_due.get(kind, 0.0))))

    alive = int(w.get("alive") or 0)
    workers = GaugeMetricFamily(
        "leasework_workers",
        "Worker rows by state: alive (a heartbeat within two intervals) or gone (stopped or "
        "silent, kept until maintenance prunes them).",
        labels=["state"],
    )
    workers.add_metric(["alive"], alive)
    workers.add_metric(["gone"], int(w.get("total") or 0) - alive)

    values: dict[tuple[str, str, str], float] = {
        (str(r["kind"]), str(r["name"]), str(r["label"])): float(r["value"]) for r in counted
    }
    finished = CounterMetricFamily(
        "leasework_runs_finished",
        "Runs that finished, by kind and outcome (retried runs count each time they finish).",
        labels=["kind", "outcome"],
    )
    lost = CounterMetricFamily(
        "leasework_lease_losses",
        "Attempts that lost their lease: expired (the lease ran out) or crashed (the supervisor "
        "saw the worker die).",
        labels=["kind", "outcome"],
    )
    reclaims = CounterMetricFamily(
        "leasework_reclaims",
        "Lost attempts whose run was claimed again by a worker.",
        labels=["kind"],
    )
    duration = HistogramMetricFamily(
        "leasework_run_duration_seconds",
        "From the start of a run's last attempt to its end, for finished runs, by kind.",
        labels=["kind"],
    )
    for kind in kinds:
        for outcome in OUTCOMES:
            finished.add_metric(
                [shown[kind], outcome], values.get((kind, "finished", outcome), 0.0)
            )
        for outcome in ("expired", "crashed"):
            lost.add_metric([shown[kind], outcome], values.get((kind, "lost", outcome), 0.0))
        reclaims.add_metric([shown[kind]], values.get((kind, "reclaimed", ""), 0.0))
        cumulative, buckets = 0.0, []
        for bound in bounds:
            cumulative += values.get((kind, "duration", f"{bound:g}"), 0.0)
            buckets.append((f"{bound:g}", cumulative))
        cumulative += values.get((kind, "duration", "+Inf"), 0.0)
        buckets.append(("+Inf", cumulative))
        duration.add_metric([shown[kind]], buckets, values.get((kind, "duration_sum", ""), 0.0))

    info = GaugeMetricFamily(
        "leasework_build_info", "The leasework version serving these metrics.", labels=["version"]
    )
    info.add_metric([version], 1)
    up = GaugeMetricFamily("leasework_database_up", "1 when the database answered.", value=1)
    return [
        up,
        info,
        runs,
        oldest,
        oldest_by_kind,
        workers,
        finished,
        lost,
        reclaims,
        duration,
        *limit_families(snap.get("limits") or []),
    ]


def limit_families(limits: Iterable[Mapping[str, Any]]) -> list[Metric]:
    """Flow control (README, "Flow control"), per kind with a limit: each limit, how full it is,
    and the due runs it holds back now (status.limits: one row per limited kind)."""
    max_running = GaugeMetricFamily(
        "leasework_kind_max_running",
        "A kind's cap: runs holding a live lease at once across every host (max_running).",
        labels=["kind"],
    )
    live = GaugeMetricFamily(
        "leasework_kind_live_leases",
        "Runs of a limited kind holding a live lease: the places its cap counts.",
        labels=["kind"],
    )
    rate = GaugeMetricFamily(
        "leasework_kind_rate_limit",
        "A kind's rate: claims at most per leasework_kind_rate_period_seconds (per tenant when "
        "rate_per is tenant).",
        labels=["kind", "per"],
    )
    period = GaugeMetricFamily(
        "leasework_kind_rate_period_seconds", "The period of a kind's rate.", labels=["kind"]
    )
    used = GaugeMetricFamily(
        "leasework_kind_rate_used",
        "Claims a kind's rate window counts now (rated per tenant: its runs without a tenant).",
        labels=["kind"],
    )
    held = GaugeMetricFamily(
        "leasework_rate_limited",
        "Due queued runs no claim may take now because of a limit: reason capped (the kind at its "
        "cap) or rate_limited (its rate's window, or its tenant's, full).",
        labels=["kind", "reason"],
    )
    for r in limits:
        kind = visible(str(r["kind"]))
        if r.get("max_running") is not None:
            max_running.add_metric([kind], float(r["max_running"]))
        live.add_metric([kind], float(r.get("running") or 0))
        if r.get("rate_count") is not None:
            rate.add_metric([kind, str(r.get("rate_per") or "kind")], float(r["rate_count"]))
            period.add_metric([kind], float(r["rate_seconds"]))
            used.add_metric([kind], float(r.get("rate_used") or 0))
        closed = r.get("closed")
        held_back = float(r.get("held_back") or 0)
        held.add_metric([kind, "capped"], held_back if closed == "capped" else 0.0)
        held.add_metric([kind, "rate_limited"], 0.0 if closed == "capped" else held_back)
    return [max_running, live, rate, period, used, held]


def database_down(version: str = "") -> list[Metric]:
    info = GaugeMetricFamily(
        "leasework_build_info", "The leasework version serving these metrics.", labels=["version"]
    )
    info.add_metric([version], 1)
    return [
        GaugeMetricFamily("leasework_database_up", "1 when the database answered.", value=0),
        info,
    ]


class _Fixed(Collector):
    def __init__(self, metrics: Iterable[Metric]) -> None:
        self._metrics = list(metrics)

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)


def exposition(metrics: Iterable[Metric]) -> bytes:
    """The Prometheus text exposition of these metric families."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(metrics))
    return generate_latest(registry)
