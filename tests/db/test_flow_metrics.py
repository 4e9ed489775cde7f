"""/metrics for flow control (docs/operations.md, "Metrics", "Flow control"): the due runs each limit holds
back now, by kind and reason (capped, rate_limited, group_full: each run under one), how long a
kind's rate window stays full, and kinds past max_kinds_shown summed under kind="other". All read
at the scrape: a claim writes nothing for them."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import psycopg

from leasework import operations
from leasework.leases import lease

from .test_metrics import metric, scrape

Conn = psycopg.Connection[Any]
PROMTOOL = shutil.which("promtool")


def enqueue(conn: Conn, kind: str, n: int, tenant: str | None = None, group: str | None = None,
            exclusive: bool = False) -> None:  # fmt: skip
    conn.execute(
        'SELECT leasework.enqueue(%s, tenant => %s, "group" => %s, exclusive => %s)'
        "  FROM generate_series(1, %s)",
        (kind, tenant, group, exclusive, n),
    )


def claim(conn: Conn, kinds: list[str], times: int = 3) -> int:
    return sum(
        len(lease.claim_runs(conn, kinds, worker=f"w{i}", lease=30, limit=5)) for i in range(times)
    )


def promtool_clean(body: bytes) -> None:
    if PROMTOOL is None:
        return
    check = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=60
    )
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr


def test_runs_held_back_by_a_full_group_are_counted_by_kind(dsn: str, conn: Conn) -> None:
    enqueue(conn, "export", 3, tenant="acme", group="g")  # one at a time: two held back
    enqueue(conn, "export", 1, tenant="acme", group="h")  # another group: claimed
    enqueue(conn, "export", 2, tenant="solo")  # no group: never group-full
    enqueue(conn, "wide", 4, tenant="acme", group="w")  # group_limit 2: two held back
    enqueue(conn, "export", 1, tenant="beta", group="g", exclusive=True)
    enqueue(conn, "export", 2, tenant="beta", group="g")  # held by beta's exclusive run instead
    operations.set_limits(conn, "wide", group_limit=2)
    claimed = claim(conn, ["export", "wide"], times=4)
    assert claimed == 1 + 1 + 2 + 2 + 1  # acme g, acme h, solo both, wide two, beta's exclusive
    body, samples = scrape(dsn)
    get = metric(samples)
    assert get("leasework_rate_limited", kind="export", reason="group_full") == 2
    assert get("leasework_rate_limited", kind="export", reason="capped") == 0
    assert get("leasework_rate_limited", kind="wide", reason="group_full") == 2
    assert get("leasework_rate_limited", kind="wide", reason="rate_limited") == 0
    promtool_clean(body)
    # A run sealed frees a place in its group: nothing held back there any more.
    conn.execute(
        "UPDATE leasework.runs SET status = 'succeeded', finished_at = now(), lease_owner = NULL,"
        " lease_expires_at = NULL WHERE id = (SELECT min(id) FROM leasework.runs"
        " WHERE kind = 'wide' AND status = 'running')"
    )
    assert metric(scrape(dsn)[1])("leasework_rate_limited", kind="wide", reason="group_full") == 0


def test_a_kind_at_its_cap_counts_its_runs_once(dsn: str, conn: Conn) -> None:
    # A capped kind's due runs are all held back by the cap: none of them also as group_full.
    enqueue(conn, "export", 3, tenant="acme", group="g")
    operations.set_limits(conn, "export", max_running=1)
    assert claim(conn, ["export"]) == 1
    get = metric(scrape(dsn)[1])
    assert get("leasework_rate_limited", kind="export", reason="capped") == 2
    assert get("leasework_rate_limited", kind="export", reason="group_full") == 0


def test_a_full_rate_window_says_when_it_has_room(dsn: str, conn: Conn) -> None:
    enqueue(conn, "metered", 3)
    operations.set_limits(conn, "metered", rate="1/10s")
    assert claim(conn, ["metered"]) == 1
    get = metric(scrape(dsn)[1])
    assert get("leasework_kind_rate_used", kind="metered") == 1
    assert 9 <= get("leasework_kind_rate_free_seconds", kind="metered") <= 10.5 + 1
    assert get("leasework_rate_limited", kind="metered", reason="rate_limited") == 2
    operations.set_limits(conn, "metered", rate="5/10s")  # room again
    get = metric(scrape(dsn)[1])
    assert get("leasework_kind_rate_free_seconds", kind="metered") == 0
    assert get("leasework_rate_limited", kind="metered", reason="rate_limited") == 0


def test_limited_kinds_past_the_setting_fold_into_other(dsn: str, conn: Conn) -> None:
    enqueue(conn, "big", 5)
    enqueue(conn, "small", 2)
    enqueue(conn, "tiny", 2, tenant="acme", group="g")
    operations.set_limits(conn, "big", max_running=1)
    operations.set_limits(conn, "small", max_running=1)
    assert claim(conn, ["big", "small", "tiny"]) == 3
    body, samples = scrape(dsn, max_kinds_shown=1)
    get = metric(samples)
    assert get("leasework_rate_limited", kind="big", reason="capped") == 4
    assert get("leasework_kind_max_running", kind="big") == 1
    # small (capped: one held back) and tiny (its group full: one) summed under other.
    assert get("leasework_rate_limited", kind="other", reason="capped") == 1
    assert get("leasework_rate_limited", kind="other", reason="group_full") == 1
    assert get("leasework_kind_live_leases", kind="other") == 1  # small's; tiny has no limit
    named = {dict(k[1]).get("kind") for k in samples if k[0].startswith("leasework_kind_max")}
    assert named == {"big"}, "a folded kind's limit was shown"
    assert not any(dict(k[1]).get("kind") in ("small", "tiny") for k in samples)
    promtool_clean(body)
