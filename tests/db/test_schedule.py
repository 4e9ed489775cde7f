"""The schedule stage on real Postgres: due connections and periodic user tasks are enqueued once
per period across several workers, next_run_at is set from now (no backlog after downtime), and
the one-active-run-per-key guarantee holds. Time moves through next_run_at, never by sleeping."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from leasework import App, ConfigError
from leasework.stages.schedule import list_schedules
from leasework.tasks import ScheduleSpec, next_fire

from .syncing import runs_of, sync_app, syncs, write_jsonl

Conn = psycopg.Connection[Any]


def db_now(conn: Conn) -> datetime:
    row = conn.execute("SELECT leasework.now()").fetchone()
    assert row is not None
    value: datetime = row[0]
    return value


def poll_all(workers: list[Any], times: int = 2) -> None:
    for _ in range(times):
        for w in workers:
            w.poll()


def schedule_row(conn: Conn, name: str) -> dict[str, Any]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        row = cur.execute("SELECT * FROM leasework.schedules WHERE name = %s", (name,)).fetchone()
    assert row is not None
    return row


def runs_of_kind(conn: Conn, kind: str) -> list[tuple[int, str]]:
    return [
        (r[0], r[1])
        for r in conn.execute(
            "SELECT id, status FROM leasework.runs WHERE kind = %s ORDER BY id", (kind,)
        ).fetchall()
    ]


# -- connections ----------------------------------------------------------------------------


def test_six_hours_down_gives_one_run(conn: Conn, make_worker: Any, tmp_path: Path) -> None:
    write_jsonl(tmp_path, "t", [{"id": 1}])
    app = sync_app()
    cid = syncs(app).connect(
        conn,
        workspace="ws",
        provider="files",
        config={"path": str(tmp_path)},
        every=900,
        sync=False,
    )
    # Last due six hours ago: 24 periods missed while nothing polled.
    conn.execute(
        "UPDATE leasework.connections SET next_run_at = leasework.now() - interval '6 hours' WHERE id = %s",
        (cid,),
    )
    workers = [make_worker(app) for _ in range(3)]
    before = db_now(conn)
    poll_all(workers, times=3)
    found = runs_of(conn, cid, "sync")
    assert [r["status"] for r in found] == ["succeeded"]
    row = conn.execute(
        "SELECT next_run_at FROM leasework.connections WHERE id = %s", (cid,)
    ).fetchone()
    assert row is not None
    ahead = (row[0] - before).total_seconds()
    assert 899 <= ahead <= 905, ahead  # from now, not from the old value


def test_due_connection_with_an_active_run_gets_no_second_run(
    conn: Conn, make_worker: Any, tmp_path: Path
) -> None:
    app = sync_app()
    cid = syncs(app).connect(
        conn, workspace="ws", provider="files", config={"path": str(tmp_path)}, every=60
    )
    # Its first sync is still queued (delayed): the due schedule is skipped, not doubled.
    conn.execute(
        "UPDATE leasework.runs SET queued_at = leasework.now() + interval '1 hour' WHERE key = %s",
        (f"leasework:connection:{cid}",),
    )
    conn.execute(
        "UPDATE leasework.connections SET next_run_at = leasework.now() - interval '1 minute' WHERE id = %s",
        (cid,),
    )
    worker = make_worker(app)
    assert worker.poll() >= 1
    assert [r["status"] for r in runs_of(conn, cid, "sync")] == ["queued"]
    row = conn.execute(
        "SELECT next_run_at > leasework.now() FROM leasework.connections WHERE id = %s", (cid,)
    ).fetchone()
    assert row == (True,)


def test_manual_and_inactive_connections_are_not_scheduled(
    conn: Conn, make_worker: Any, tmp_path: Path
) -> None:
    app = sync_app()
    manual = syncs(app).connect(
        conn, workspace="ws", provider="files", config={"path": str(tmp_path)}, sync=False
    )
    off = syncs(app).connect(
        conn, workspace="ws", provider="files", config={"path": str(tmp_path)}, every=60, sync=False
    )
    syncs(app).disconnect(conn, off)
    assert conn.execute(
        "SELECT next_run_at FROM leasework.connections WHERE id = %s", (manual,)
    ).fetchone() == (None,)
    # Even a disconnected connection whose next_run_at is past is not scheduled.
    conn.execute(
        "UPDATE leasework.connections SET next_run_at = leasework.now() - interval '1 day' WHERE id = %s",
        (off,),
    )
    poll_all([make_worker(app)])
    assert runs_of(conn, manual) == [] and runs_of(conn, off) == []


# -- periodic user tasks ---------------------------------------------------------------------


def periodic_app(**schedule: Any) -> tuple[App, list[dict[str, Any]]]:
    app = sync_app()
    calls: list[dict[str, Any]] = []

    @app.task("tick", **schedule)
    def tick(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
        calls.append(payload)
        return {"n": len(calls)}

    return app, calls


def test_every_fires_once_per_period_across_workers_and_never_backfills(
    conn: Conn, make_worker: Any
) -> None:
    app, calls = periodic_app(every=60)
    workers = [make_worker(app) for _ in range(3)]
    poll_all(workers, times=3)
    # A new `every` schedule fires at once, once, however many workers poll.
    assert [s for _, s in runs_of_kind(conn, "tick")] == ["succeeded"]
    row = schedule_row(conn, "tick")
    assert 59 <= (row["next_run_at"] - db_now(conn)).total_seconds() <= 61
    run = conn.execute("SELECT key, payload FROM leasework.runs WHERE kind = 'tick'").fetchone()
    assert run is not None and run[0] == "schedule:tick" and "scheduled_at" in run[1]

    # One period passes: one more run.
    conn.execute("UPDATE leasework.schedules SET next_run_at = leasework.now() WHERE name = 'tick'")
    poll_all(workers, times=3)
    assert len(runs_of_kind(conn, "tick")) == 2

    # Down for a day (1440 periods): one run, and next_run_at from now.
    conn.execute(
        "UPDATE leasework.schedules SET next_run_at = leasework.now() - interval '1 day' WHERE name = 'tick'"
    )
    before = db_now(conn)
    poll_all(workers, times=3)
    assert [s for _, s in runs_of_kind(conn, "tick")] == ["succeeded"] * 3
    assert len(calls) == 3
    row = schedule_row(conn, "tick")
    assert 59 <= (row["next_run_at"] - before).total_seconds() <= 62


def test_cron_fires_once_per_period_in_its_time_zone(conn: Conn, make_worker: Any) -> None:
    app, calls = periodic_app(cron="*/15 * * * *", tz="Asia/Kolkata")  # a +05:30 zone
    workers = [make_worker(app) for _ in range(3)]
    start = db_now(conn)
    poll_all(workers)
    # A new cron schedule waits for its next match: nothing yet.
    assert runs_of_kind(conn, "tick") == []
    row = schedule_row(conn, "tick")
    first = row["next_run_at"]
    assert first == next_fire(
        ScheduleSpec.make("tick", cron="*/15 * * * *", tz="Asia/Kolkata"), start
    )
    assert first.astimezone(UTC).minute % 15 == 0 and first > start
    assert (first - start) <= timedelta(minutes=15)

    # Its time comes (moved, not waited for), after six hours down: one run across workers.
    conn.execute(
        "UPDATE leasework.schedules SET next_run_at = leasework.now() - interval '6 hours' WHERE name = 'tick'"
    )
    before = db_now(conn)
    poll_all(workers, times=3)
    assert [s for _, s in runs_of_kind(conn, "tick")] == ["succeeded"]
    nxt = schedule_row(conn, "tick")["next_run_at"]
    assert before < nxt <= before + timedelta(minutes=15)
    assert nxt.astimezone(UTC).minute % 15 == 0 and nxt.second == 0
    assert len(calls) == 1


def test_periodic_task_keeps_one_active_run(conn: Conn, make_worker: Any) -> None:
    app, _ = periodic_app(every=60)
    worker = make_worker(app)
    # An earlier run of this schedule is still queued (delayed an hour).
    held = app.enqueue(conn, "tick", {}, key="schedule:tick", delay=3600)
    worker.poll()
    assert runs_of_kind(conn, "tick") == [(held, "queued")]
    assert schedule_row(conn, "tick")["last_run_id"] == held


def test_restart_keeps_next_run_and_a_changed_spec_starts_over(
    conn: Conn, make_worker: Any
) -> None:
    app, _ = periodic_app(every=3600)
    make_worker(app).poll()
    first = schedule_row(conn, "tick")["next_run_at"]
    make_worker(app).poll()  # a restarted worker registers the same spec again
    assert schedule_row(conn, "tick")["next_run_at"] == first
    assert len(runs_of_kind(conn, "tick")) == 1

    changed, _ = periodic_app(cron="0 3 * * *", tz="Europe/Berlin")
    make_worker(changed).poll()
    row = schedule_row(conn, "tick")
    assert row["cron"] == "0 3 * * *" and row["every_seconds"] is None
    assert row["next_run_at"] != first
    assert row["next_run_at"].astimezone(UTC).hour in (1, 2)  # 03:00 in Berlin
    listed = list_schedules(conn)
    assert [(s["name"], s["last_run_status"]) for s in listed] == [("tick", "succeeded")]


def test_schedule_spec_validation() -> None:
    app = sync_app()
    with pytest.raises(ConfigError, match="exactly one"):
        app.task("a", every=5, cron="* * * * *")
    with pytest.raises(ConfigError, match="cron"):
        app.task("b", cron="every monday")
    with pytest.raises(ConfigError, match="time zone"):
        app.task("c", cron="* * * * *", tz="Mars/Olympus")
    with pytest.raises(ConfigError, match="every"):
        app.task("d", every=0)
    assert app.schedules == {}
