"""`status.collect()` on real rows: progress with rate and ETA (measured between snapshots),
failures being retried, and the 80-column rendering of the same snapshot."""

from __future__ import annotations

from typing import Any

import psycopg

from leasework import App, status


def test_snapshot_has_progress_rate_eta_and_retrying_failures(
    conn: psycopg.Connection[Any],
) -> None:
    app = App()

    @app.task("report")
    def report(ctx: Any, payload: Any) -> None: ...

    busy = app.enqueue(conn, "report", {})
    failing = app.enqueue(conn, "report", {})
    conn.execute(
        "UPDATE leasework.runs SET status = 'running', attempts = 1, lease_owner = gen_random_uuid(),"
        " lease_expires_at = now() + interval '2 minutes', started_at = now() - interval '10 seconds',"
        " processed_units = 20, total_units = 100 WHERE id = %s",
        (busy,),
    )
    conn.execute(
        "UPDATE leasework.runs SET attempts = 1, error = 'ConnectionError: upstream timed out',"
        " history = jsonb_build_array(jsonb_build_object('attempt', 1, 'ended_at', now(),"
        " 'outcome', 'failed')) WHERE id = %s",
        (failing,),
    )
    first = status.collect(conn)
    (run,) = first["running"]
    assert run["id"] == busy and 1.5 < run["rate"] < 2.5  # 20 units in ~10 s
    assert 30 < run["eta"] < 50
    (failure,) = first["recent_failures"]
    assert failure["id"] == failing and failure["will_retry"]
    assert failure["error"].startswith("ConnectionError")

    conn.execute("UPDATE leasework.runs SET processed_units = 60 WHERE id = %s", (busy,))
    later = dict(first, taken_at=first["taken_at"] - 4.0)  # as if taken 4 s earlier
    second = status.collect(conn, previous=later)
    (run,) = second["running"]
    assert 8 < run["rate"] < 12  # 40 units between the snapshots, ~4 s apart
    text = status.render(second)
    assert "retrying" in text and "eta" in text
    assert all(len(line) <= 80 for line in text.splitlines())


def test_status_shows_each_limit_and_how_full_it_is(conn: psycopg.Connection[Any]) -> None:
    from leasework import operations
    from leasework.leases import lease

    app = App()

    @app.task("export", max_running=1)
    def export(ctx: Any, payload: Any) -> None: ...

    @app.task("crm.sync", rate="2/10s", rate_per="tenant")
    def crm_sync(ctx: Any, payload: Any) -> None: ...

    operations.declare_limits(conn, {k: dict(t.limits) for k, t in app.tasks.items()})
    app.enqueue_many(conn, "export", [{}, {}, {}])
    app.enqueue_many(conn, "crm.sync", [{}, {}, {}], tenant="acme")
    app.enqueue(conn, "crm.sync", {}, tenant="beta")
    kinds = ["crm.sync", "export"]
    for i in range(4):
        lease.claim_runs(conn, kinds, worker=f"w{i}", lease=30, limit=1)
    operations.set_tenant_rate(conn, "crm.sync", "beta", "5/10s")
    snap = status.collect(conn)
    by_kind = {r["kind"]: r for r in snap["limits"]}
    assert by_kind["export"]["running"] == 1 and by_kind["export"]["closed"] == "capped"
    assert by_kind["export"]["held_back"] == 2  # at its cap: every due run waits
    # acme used its 2 in the window: its third run is held back; beta's went.
    assert by_kind["crm.sync"]["held_back"] == 1 and by_kind["crm.sync"]["closed"] is None
    assert snap["unserved"] == []  # waiting for a place or room is not "no worker serves it"
    text = status.render(snap)
    assert "limits:" in text
    assert "export: max_running 1/1" in text and "at its cap, 2 of 2 due held back" in text
    assert "crm.sync: rate 2/10s per tenant" in text and "1 of 1 due held back" in text
    assert "tenant beta: rate* 5/10s" in text
    assert all(len(line) <= 80 for line in text.splitlines())
