"""`/metrics`: Prometheus text format, computed from the database at each scrape (prometheus-client
metric families). Counters are durable: the runs in the table plus what runs that left it handed
over to leasework.counters (schema.sql), so they only go up, survive restarts, and every dashboard
process (on any host) reports the same figures. Only reads."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
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
from ..status import OTHER, shown_kinds
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
# leasework.attempt_outcome (schema.sql): how an attempt ended.
ATTEMPT_OUTCOMES = (
    "succeeded", "failed", "retried", "timed_out", "cancelled", "released", "snoozed", "lost"
)


def families(
    conn: psycopg.Connection[Any],
    snap: Mapping[str, Any],
    *,
    heartbeat_interval: float,
    version: str = "",
    max_kinds: int | None = None,
) -> list[Metric]:
    """Every metric family for one scrape. `snap` is `status.collect()`'s snapshot, unfolded (runs
    by kind and status, the oldest due run per kind); the rest comes from dashboard.sql. With
    `max_kinds` (config `max_kinds_shown`), the kinds past the `max_kinds` with the most runs in
    the table (status.shown_kinds) are summed under kind="other": the size of a scrape is bounded
    whatever the number of kinds."""
    stale = {"stale": heartbeat_interval * 2}
    with conn.cursor(row_factory=dict_row) as cur:
        w = cur.execute(Q["metrics_workers"], stale).fetchone() or {}
        pooled = cur.execute(Q["metrics_pools"], stale).fetchall()
        counted = cur.execute(Q["metrics_counters"]).fetchall()
        row = cur.execute(Q["metrics_duration_buckets"]).fetchone()
        grouped = cur.execute(Q["metrics_group_full"]).fetchall()
    bounds = [float(b) for b in (row or {}).get("buckets") or []]
    by_kind: dict[str, dict[str, int]] = dict(snap.get("runs_by_kind") or {})
    seen = set(by_kind) | {str(r["kind"]) for r in counted}
    shown_set = seen if max_kinds is None else shown_kinds(by_kind, max_kinds, seen)
    # A label value as every reader shows it: a kind stored before the kind rule held shows its
    # controls escaped (the exposition format escapes only backslash, quote and newline).
    label = {kind: visible(kind) if kind in shown_set else OTHER for kind in seen}
    labels = sorted(set(label.values()))

    def add(into: dict[Any, float], key: Any, value: float) -> None:
        into[key] = into.get(key, 0.0) + value

    per_status: dict[tuple[str, str], float] = {}
    for kind, per in by_kind.items():
        for status in STATUSES:
            add(per_status, (label[kind], status), float(per.get(status, 0)))
    runs = GaugeMetricFamily(
        "leasework_runs", "Runs in the table by kind and status.", labels=["kind", "status"]
    )
    for name in labels:
        for status in STATUSES:
            runs.add_metric([name, status], per_status.get((name, status), 0.0))

    oldest_due: Mapping[str, float] = snap.get("oldest_due") or {}
    oldest = GaugeMetricFamily(
        "leasework_oldest_queued_age_seconds",
        "How long the oldest due queued run has waited (0 when none is waiting).",
        value=max([0.0, *(max(0.0, a) for a in oldest_due.values())]),
    )
    ages: dict[str, float] = {}
    for kind, age in oldest_due.items():
        name = label.get(kind, OTHER)
        ages[name] = max(ages.get(name, 0.0), max(0.0, float(age)))
    oldest_by_kind = GaugeMetricFamily(
        "leasework_kind_oldest_queued_age_seconds",
        "How long the oldest due queued run of each kind has waited (0 when none is waiting).",
        labels=["kind"],
    )
    for name in labels:
        oldest_by_kind.add_metric([name], ages.get(name, 0.0))

    alive = int(w.get("alive") or 0)
    workers = GaugeMetricFamily(
        "leasework_workers",
        "Worker rows by state: alive (a heartbeat within two intervals) or gone (stopped or "
        "silent, kept until maintenance prunes them).",
        labels=["state"],
    )
    workers.add_metric(["alive"], alive)
    workers.add_metric(["gone"], int(w.get("total") or 0) - alive)
    pools = GaugeMetricFamily(
        "leasework_pool_workers",
        "Live workers by pool (config pools; pool=\"\" for workers without one) and state: "
        "busy (holding a run) or idle.",
        labels=["pool", "state"],
    )
    for r in pooled:
        pool = visible(str(r["pool"])) if r["pool"] is not None else ""
        pools.add_metric([pool, "busy"], float(r["busy"]))
        pools.add_metric([pool, "idle"], float(r["alive"] - r["busy"]))

    values: dict[tuple[str, str, str], float] = {}
    for r in counted:
        add(values, (label[str(r["kind"])], str(r["name"]), str(r["label"])), float(r["value"]))
    finished = CounterMetricFamily(
        "leasework_runs_finished",
        "Runs that finished, by kind and outcome (retried runs count each time they finish).",
        labels=["kind", "outcome"],
    )
    attempts = CounterMetricFamily(
        "leasework_attempts",
        "Ended attempts by kind and outcome: succeeded, failed (raised, Fail or Partial; retried "
        "or not), retried (raised Retry), timed_out, cancelled, released (given back at "
        "shutdown), snoozed, lost (the lease expired or the worker crashed).",
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
    debounced = CounterMetricFamily(
        "leasework_debounced",
        "Enqueues a debounce merged into a pending run of the kind (its first enqueue aside).",
        labels=["kind"],
    )
    duration = HistogramMetricFamily(
        "leasework_run_duration_seconds",
        "From the start of a run's last attempt to its end, for finished runs, by kind.",
        labels=["kind"],
    )
    wait = HistogramMetricFamily(
        "leasework_queue_wait_seconds",
        "From when a finished run's last attempt was due to when it started, by kind.",
        labels=["kind"],
    )

    def buckets(name: str, what: str) -> tuple[list[tuple[str, float]], float]:
        cumulative, out = 0.0, []
        for bound in bounds:
            cumulative += values.get((name, what, f"{bound:g}"), 0.0)
            out.append((f"{bound:g}", cumulative))
        cumulative += values.get((name, what, "+Inf"), 0.0)
        out.append(("+Inf", cumulative))
        return out, values.get((name, what + "_sum", ""), 0.0)

    for name in labels:
        for outcome in OUTCOMES:
            finished.add_metric([name, outcome], values.get((name, "finished", outcome), 0.0))
        for outcome in ATTEMPT_OUTCOMES:
            attempts.add_metric([name, outcome], values.get((name, "attempts", outcome), 0.0))
        for outcome in ("expired", "crashed"):
            lost.add_metric([name, outcome], values.get((name, "lost", outcome), 0.0))
        reclaims.add_metric([name], values.get((name, "reclaimed", ""), 0.0))
        debounced.add_metric([name], values.get((name, "debounced", ""), 0.0))
        duration.add_metric([name], *buckets(name, "duration"))
        wait.add_metric([name], *buckets(name, "wait"))

    info = GaugeMetricFamily(
        "leasework_build_info", "The leasework version serving these metrics.", labels=["version"]
    )
    info.add_metric([version], 1)
    up = GaugeMetricFamily("leasework_database_up", "1 when the database answered.", value=1)
    kinds = GaugeMetricFamily(
        "leasework_kinds",
        "Kinds seen (in the table or the counters): shown with a label of their own, or folded "
        "into kind=\"other\" (config max_kinds_shown).",
        labels=["state"],
    )
    folded = sum(1 for kind in seen if label[kind] == OTHER)
    kinds.add_metric(["shown"], len(seen) - folded)
    kinds.add_metric(["folded"], folded)
    return [
        up,
        info,
        kinds,
        runs,
        oldest,
        oldest_by_kind,
        workers,
        pools,
        finished,
        attempts,
        lost,
        reclaims,
        debounced,
        duration,
        wait,
        *limit_families(
            snap.get("limits") or [],
            {str(r["kind"]): int(r["n"]) for r in grouped},
            labels=lambda kind: label.get(kind, OTHER if max_kinds is not None else visible(kind)),
        ),
    ]


def limit_families(
    limits: Iterable[Mapping[str, Any]],
    group_full: Mapping[str, int] | None = None,
    labels: Callable[[str], str] = visible,
) -> list[Metric]:
    """Flow control (docs/flow-control.md), per kind with a limit: each limit, how full it is,
    and the due runs it holds back now (status.limits: one row per limited kind), and per kind
    the due runs its groups hold back (`group_full`: dashboard.sql, metrics_group_full). All read
    at the scrape: the claim writes nothing for them. `labels` gives a kind's label (OTHER for a
    kind past max_kinds_shown): a folded kind's live leases and held-back runs are summed under
    it; its limits, which do not add up, are not shown."""
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
        "A kind's rate: claims at most per leasework_kind_rate_period_seconds (per tenant, or per "
        "tenant's group, when rate_per is tenant or group).",
        labels=["kind", "per"],
    )
    period = GaugeMetricFamily(
        "leasework_kind_rate_period_seconds", "The period of a kind's rate.", labels=["kind"]
    )
    used = GaugeMetricFamily(
        "leasework_kind_rate_used",
        "Claims a kind's rate window counts now (rated per tenant or group: its runs without a "
        "tenant).",
        labels=["kind"],
    )
    free = GaugeMetricFamily(
        "leasework_kind_rate_free_seconds",
        "Seconds until a kind's rate window has room for one more claim (0: it has room now; "
        "rated per tenant: its runs without a tenant).",
        labels=["kind"],
    )
    held = GaugeMetricFamily(
        "leasework_rate_limited",
        "Due queued runs no claim may take now because of a limit, each under one reason: capped "
        "(the kind at its cap), rate_limited (its rate's window, or its tenant's or group's, full), "
        "group_full (its tenant's group holds as many live leases as the kind's group_limit).",
        labels=["kind", "reason"],
    )
    reasons = ("capped", "rate_limited", "group_full")
    sums: dict[tuple[str, str], float] = {}
    leases: dict[str, float] = {}
    closed_kinds: set[str] = set()

    def add(name: str, reason: str, value: float) -> None:
        sums[name, reason] = sums.get((name, reason), 0.0) + value

    for r in limits:
        kind = str(r["kind"])
        name = labels(kind)
        leases[name] = leases.get(name, 0.0) + float(r.get("running") or 0)
        closed = r.get("closed")
        held_back = float(r.get("held_back") or 0)
        add(name, "capped", held_back if closed == "capped" else 0.0)
        add(name, "rate_limited", 0.0 if closed == "capped" else held_back)
        if closed:
            closed_kinds.add(kind)  # every due run counted above, under its kind's reason
        if name == OTHER:
            continue
        if r.get("max_running") is not None:
            max_running.add_metric([name], float(r["max_running"]))
        if r.get("rate_count") is not None:
            rate.add_metric([name, str(r.get("rate_per") or "kind")], float(r["rate_count"]))
            period.add_metric([name], float(r["rate_seconds"]))
            used.add_metric([name], float(r.get("rate_used") or 0))
            free.add_metric([name], float(r.get("rate_free_in") or 0))
    for kind, n in (group_full or {}).items():
        name = labels(kind)
        for reason in reasons:
            add(
                name, reason, float(n) if reason == "group_full" and kind not in closed_kinds else 0
            )
    for name, count in sorted(leases.items()):
        live.add_metric([name], count)
    for name in sorted({held_name for held_name, _ in sums}):
        for reason in reasons:
            held.add_metric([name, reason], sums.get((name, reason), 0.0))
    return [max_running, live, rate, period, used, free, held]


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
