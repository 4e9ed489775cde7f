"""`/metrics`: Prometheus text format, computed from the database at each scrape (prometheus-client
metric families; no counters are kept in memory, so every dashboard process reports the same).
Only reads."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from psycopg.rows import dict_row

from ..queries import load

Q = load("leasework.dashboard", "dashboard.sql")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Claim latency buckets, seconds: a NOTIFY wakes a worker in milliseconds; the idle poll is 2 s.
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
LATENCY_WINDOW = 900.0


def families(
    conn: psycopg.Connection[Any],
    snap: Mapping[str, Any],
    *,
    heartbeat_interval: float,
) -> list[Metric]:
    """Every metric family for one scrape. `snap` is `status.collect()`'s snapshot (runs by kind
    and status); the rest comes from dashboard.sql."""
    runs = GaugeMetricFamily(
        "leasework_runs", "Runs in the table by kind and status.", labels=["kind", "status"]
    )
    for kind, per in sorted((snap.get("runs_by_kind") or {}).items()):
        for status, n in sorted(per.items()):
            runs.add_metric([kind, status], n)

    with conn.cursor(row_factory=dict_row) as cur:
        w = cur.execute(Q["metrics_workers"], {"stale": heartbeat_interval * 2}).fetchone() or {}
        oldest = cur.execute(Q["metrics_oldest_queued"]).fetchall()
        losses = cur.execute(Q["metrics_lease_losses"]).fetchall()
        lat = cur.execute(
            Q["metrics_claim_latency"],
            {"window": LATENCY_WINDOW, "buckets": list(LATENCY_BUCKETS)},
        ).fetchone() or {"n": 0, "total": 0.0, "cumulative": [0] * len(LATENCY_BUCKETS)}

    alive = int(w.get("alive") or 0)
    workers_alive = GaugeMetricFamily(
        "leasework_workers_alive", "Worker processes with a recent heartbeat.", value=alive
    )
    workers_gone = GaugeMetricFamily(
        "leasework_workers_gone",
        "Worker rows that stopped or went silent (kept until maintenance prunes them).",
        value=int(w.get("total") or 0) - alive,
    )
    oldest_age = GaugeMetricFamily(
        "leasework_oldest_queued_age_seconds",
        "Age of the oldest due queued run, by kind (absent when none is waiting).",
        labels=["kind"],
    )
    for row in oldest:
        oldest_age.add_metric([row["kind"]], max(0.0, row["age"]))
    lost = GaugeMetricFamily(
        "leasework_lease_losses",
        "Attempts that lost their lease, among runs still in the table; outcome `expired` (the "
        "lease ran out) or `crashed` (the supervisor saw the worker die).",
        labels=["kind", "outcome"],
    )
    reclaims = GaugeMetricFamily(
        "leasework_reclaims",
        "Lost attempts whose run was claimed again by a worker, among runs still in the table.",
        labels=["kind"],
    )
    reclaimed_by_kind: dict[str, int] = {}
    for row in losses:
        lost.add_metric([row["kind"], row["outcome"]], row["losses"])
        reclaimed_by_kind[row["kind"]] = reclaimed_by_kind.get(row["kind"], 0) + row["reclaimed"]
    for kind, n in sorted(reclaimed_by_kind.items()):
        reclaims.add_metric([kind], n)
    latency = HistogramMetricFamily(
        "leasework_claim_latency_seconds",
        f"From due (queued_at) to claimed (started_at), for runs claimed in the last "
        f"{LATENCY_WINDOW:g} s.",
    )
    cumulative = [int(c) for c in lat["cumulative"]]
    buckets = [(_le(b), c) for b, c in zip(LATENCY_BUCKETS, cumulative, strict=True)]
    buckets.append(("+Inf", int(lat["n"])))
    latency.add_metric([], buckets, float(lat["total"]))
    up = GaugeMetricFamily("leasework_database_up", "1 when the database answered.", value=1)
    return [up, runs, oldest_age, workers_alive, workers_gone, lost, reclaims, latency]


def database_down() -> list[Metric]:
    return [GaugeMetricFamily("leasework_database_up", "1 when the database answered.", value=0)]


def _le(bound: float) -> str:
    return f"{bound:g}"


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
