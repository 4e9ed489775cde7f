"""Rate limits per group (rate_per="group", migration 0038): each tenant's group of a rated kind
has its own budget of the rate (leasework.group_rates), a tenant's runs without a group share
the tenant's, runs without a tenant share one; an operator's rate for a tenant holds each of its
groups. The claim never reads the queued runs of a group whose budget is spent; an idle worker
sleeps until a budget frees; `show` names the group's rate; maintenance prunes quiet windows.
Time moves by the database clock, never by sleeping."""

from __future__ import annotations

from collections import Counter
from typing import Any

import psycopg
import pytest

from leasework import App, operations, status
from leasework.config import Config
from leasework.errors import ConfigError
from leasework.leases import lease
from leasework.stages.maintenance import prune_rate_windows

from ...conftest import shift_clock
from ..checks import KINDS, LEASE, admit_holds_each_group_to_its_rate, claim_buffers, make_app

Conn = psycopg.Connection[Any]


def per_group(conn: Conn, rate: str = "2/60s", group_limit: int = 100) -> None:
    # A wide group_limit, so that only the rate holds a group back.
    operations.set_limits(
        conn, "job", known=KINDS, rate=rate, rate_per="group", group_limit=group_limit
    )


def drain(conn: Conn, rounds: int = 30) -> list[int]:
    """Claim and seal until a claim takes nothing (one run per tenant per claim)."""
    got: list[int] = []
    for i in range(rounds):
        claims = lease.claim_runs(conn, KINDS, worker=f"w{i}", lease=LEASE, limit=10)
        if not claims:
            break
        got += [c.id for c in claims]
        for claim in claims:
            assert lease.finish(conn, claim, "succeeded")
    return got


def budgets(conn: Conn, ids: list[int]) -> Counter[tuple[Any, Any]]:
    rows = conn.execute(
        'SELECT tenant, "group" FROM leasework.runs WHERE id = ANY(%s)', (ids,)
    ).fetchall()
    return Counter((r[0], r[1]) for r in rows)


def test_a_rate_per_group_gives_each_tenants_group_its_budget(conn: Conn) -> None:
    app = make_app()
    for tenant, group in [("t1", "g1"), ("t1", "g2"), ("t1", None), ("t2", "g1"), (None, None)]:
        for _ in range(4):
            app.enqueue(conn, "job", {}, tenant=tenant, group=group)
    per_group(conn)
    got = drain(conn)
    assert budgets(conn, got) == {
        ("t1", "g1"): 2, ("t1", "g2"): 2, ("t1", None): 2, ("t2", "g1"): 2, (None, None): 2,
    }  # fmt: skip
    # An operator's rate for t1 holds each of t1's budgets: one more each, t2's unchanged.
    operations.set_tenant_rate(conn, "job", "t1", "3/60s")
    more = drain(conn)
    assert budgets(conn, more) == {("t1", "g1"): 1, ("t1", "g2"): 1, ("t1", None): 1}
    assert [r["tenant"] for r in status.limits(conn)[0]["tenant_rates"]] == ["t1"]
    # A period and a slice on, every budget has room again.
    shift_clock(conn, 63.1)
    assert budgets(conn, drain(conn)) == {
        ("t1", "g1"): 1, ("t1", "g2"): 1, ("t1", None): 1, ("t2", "g1"): 2, (None, None): 2,
    }  # fmt: skip


def test_admit_holds_each_group_to_its_window(conn: Conn) -> None:
    # leasework.admit itself (the check test_mutations breaks it for), and the windows it wrote.
    admit_holds_each_group_to_its_rate(conn)
    windows = conn.execute(
        'SELECT tenant, "group" FROM leasework.group_rates ORDER BY 1, 2'
    ).fetchall()
    assert windows == [("t1", "g1"), ("t1", "g2")]


def test_the_claim_reads_no_run_of_a_group_whose_budget_is_spent(conn: Conn) -> None:
    # 5,000 queued runs of tenant big's group g, whose budget is spent, ahead of one run of its
    # group h: the claim takes h's run reading a handful of index pages, not g's runs.
    app = make_app()
    per_group(conn, rate="1/1h")
    first = app.enqueue(conn, "job", {}, tenant="big", group="g")
    claimed = lease.claim_runs(conn, KINDS, worker="w0", lease=LEASE)
    assert [c.id for c in claimed] == [first]
    assert lease.finish(conn, claimed[0], "succeeded")  # nothing of big's is running now
    conn.execute(
        'INSERT INTO leasework.runs (kind, tenant, "group")'
        " SELECT 'job', 'big', 'g' FROM generate_series(1, 5000);"
        "ANALYZE leasework.runs"
    )
    wanted = app.enqueue(conn, "job", {}, tenant="big", group="h")
    buffers = claim_buffers(conn, KINDS)
    # About 300 here (the admission's windows and shards, the budget probes), whatever g holds:
    # a walk that read g's runs would visit each of them, 5,000 heap pages and more.
    assert buffers < 600, buffers
    row = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (wanted,)).fetchone()
    assert row == ("running",)


def test_an_exclusive_run_counts_against_its_groups_budget(conn: Conn) -> None:
    app = make_app()
    per_group(conn, rate="1/60s")
    a = app.enqueue(conn, "job", {}, tenant="t1", group="g", exclusive=True)
    b = app.enqueue(conn, "job", {}, tenant="t1", group="g", exclusive=True)
    c = app.enqueue(conn, "job", {}, tenant="t1", group="h")
    claims = lease.claim_runs(conn, KINDS, worker="w", lease=LEASE)
    assert [x.id for x in claims] == [a]
    assert lease.finish(conn, claims[0], "succeeded")
    # b's group has spent its budget; c's has not.
    assert [x.id for x in lease.claim_runs(conn, KINDS, worker="w", lease=LEASE)] == [c]
    assert b not in drain(conn)


def test_an_exclusive_run_behind_a_spent_groups_backlog_is_taken(conn: Conn) -> None:
    # Past the four runs read in order (all of g, whose budget is spent), the exclusive run of
    # group h is found group by group once nothing of its tenant runs.
    app = make_app()
    per_group(conn, rate="1/1h")
    first = app.enqueue(conn, "job", {}, tenant="t1", group="g")
    (claim,) = lease.claim_runs(conn, KINDS, worker="w", lease=LEASE)
    assert claim.id == first
    for _ in range(5):
        app.enqueue(conn, "job", {}, tenant="t1", group="g")
    wanted = app.enqueue(conn, "job", {}, tenant="t1", group="h", exclusive=True)
    assert lease.claim_runs(conn, KINDS, worker="w", lease=LEASE) == []  # g's run still runs
    assert lease.finish(conn, claim, "succeeded")
    assert [c.id for c in lease.claim_runs(conn, KINDS, worker="w", lease=LEASE)] == [wanted]


def test_an_idle_worker_sleeps_until_a_groups_budget_frees_and_show_says_why(
    conn: Conn,
) -> None:
    app = make_app()
    per_group(conn, rate="1/60s")
    runs = [app.enqueue(conn, "job", {}, tenant="t1", group="g") for _ in range(3)]
    (claim,) = lease.claim_runs(conn, KINDS, worker="w", lease=LEASE)
    assert claim.id == runs[0]
    assert lease.finish(conn, claim, "succeeded")  # no lease left to wake up for
    # Every due run waits for group g's budget: next_due is when it frees (a period and at most
    # a slice, 3 s, after the claim), not now.
    due = lease.next_due(conn, ["job"])
    assert due is not None and 55.0 < due <= 63.0, due
    why = operations.held_back(conn, runs[1])
    assert [h["reason"] for h in why] == ["rate_limited"]
    assert why[0]["per"] == "group" and why[0]["rate_count"] == 1
    # A run of another group is due at once.
    other = app.enqueue(conn, "job", {}, tenant="t1", group="h")
    due = lease.next_due(conn, ["job"])
    assert due is not None and due <= 0.0, due
    (claim,) = lease.claim_runs(conn, KINDS, worker="w", lease=LEASE)
    assert claim.id == other
    assert lease.finish(conn, claim, "succeeded")
    shift_clock(conn, 63.1)
    assert drain(conn) == runs[1:2]


def test_held_back_counts_runs_of_groups_at_their_rate(conn: Conn) -> None:
    app = make_app()
    per_group(conn, rate="1/60s")
    for group in ("g", "g", "g", "h"):
        app.enqueue(conn, "job", {}, tenant="t1", group=group)
    assert len(drain(conn)) == 2  # one of g's, h's
    row = status.limits(conn)[0]
    assert row["rate_per"] == "group"
    assert row["held_back"] == 2  # g's other two; h has none queued


def test_maintenance_prunes_group_windows_that_count_nothing(conn: Conn) -> None:
    app = make_app()
    per_group(conn, rate="1/10s")
    for group in ("g1", "g2", "g3"):
        app.enqueue(conn, "job", {}, tenant="t1", group=group)
    assert len(drain(conn)) == 3

    def rows() -> list[str]:
        return [r[0] for r in conn.execute('SELECT "group" FROM leasework.group_rates ORDER BY 1')]

    assert rows() == ["g1", "g2", "g3"]
    assert prune_rate_windows(conn, Config(), 100) == 0  # every window still counts its claim
    shift_clock(conn, 10.6)
    assert prune_rate_windows(conn, Config(), 2) == 2  # bounded
    assert prune_rate_windows(conn, Config(), 100) == 1
    assert rows() == []


def test_rate_per_group_is_declared_and_set_as_tenant_is() -> None:
    app = App()

    @app.task("crm.sync", rate="100/10s", rate_per="group")
    def sync(ctx: Any, payload: Any) -> None:
        return None

    assert operations.declared_limits(rate="100/10s", rate_per="group") == {
        "rate": [100, 10.0],
        "rate_per": "group",
    }
    with pytest.raises(ConfigError, match=r"rate_per='group' needs a rate= \(each tenant's group"):
        operations.declared_limits(rate_per="group")
    with pytest.raises(ConfigError, match="rate_per must be 'tenant' or 'group'"):
        operations.declared_limits(rate="1/s", rate_per="key")


def test_the_database_refuses_an_unknown_rate_per(conn: Conn) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(
            "INSERT INTO leasework.kind_limits (kind, overrides)"
            """ VALUES ('job', '{"rate": [1, 1.0], "rate_per": "key"}')"""
        )
