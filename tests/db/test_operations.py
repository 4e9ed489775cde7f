"""The operator's Python API (leasework.operations, App's thin methods): look runs up, list them
with filters and keyset paging, retry, delete, pause and resume; bad input changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from leasework import App, ConfigError, Context, StateConflict, operations
from leasework.leases import lease
from leasework.operations import Filters
from leasework.workers.worker import Worker

from ..conftest import expire_lease, get_run, shift_clock
from .checks import TENANTS, paused_kind_is_never_claimed

Conn = psycopg.Connection[Any]


def make_app() -> App:
    app = App()

    @app.task("ok")
    def ok(ctx: Context, payload: Any) -> Any:
        return {"echo": payload}

    @app.task("boom", max_attempts=2)
    def boom(ctx: Context, payload: Any) -> Any:
        raise RuntimeError("boom: the first line\nand a second")

    @app.task("batchy", batch=10)
    def batchy(ctx: Context, payload: Any) -> Any:
        return None

    return app


def snapshot(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT * FROM leasework.runs ORDER BY id").fetchall()


def fail_for_good(conn: Conn, app: App, make_worker: Callable[..., Worker], **kw: Any) -> int:
    run_id = app.enqueue(conn, "boom", **kw)
    worker = make_worker(app)
    for _ in range(2):
        conn.execute(
            "UPDATE leasework.runs SET queued_at = leasework.now() WHERE id = %s", (run_id,)
        )
        worker.poll()
    assert get_run(conn, run_id)["status"] == "failed"
    return run_id


def test_enqueue_says_when_it_returned_the_keys_existing_run(conn: Conn) -> None:
    app = make_app()
    first = app.enqueue_run(conn, "ok", key="k1")
    again = app.enqueue_run(conn, "ok", key="k1")
    assert again.run_id == first.run_id and type(again.run_id) is int
    assert first.existing is False and again.existing is True
    assert app.enqueue_run(conn, "ok", key="k2").existing is False
    assert app.enqueue(conn, "ok", key="k1") == first.run_id  # still a plain id


def test_get_and_list_runs_filter_and_page_newest_first(conn: Conn) -> None:
    app = make_app()
    ids = [app.enqueue(conn, "ok", {"i": i}, tenant="t1" if i % 2 else None) for i in range(7)]
    keyed = app.enqueue(conn, "boom", key="acct-7")
    run = operations.get_run(conn, keyed)
    assert run is not None and run["kind"] == "boom" and run["key"] == "acct-7"
    assert run["kind_paused"] is False
    assert operations.get_run(conn, 999_999) is None

    page = app.list_runs(conn, limit=3)
    assert [r["id"] for r in page.runs] == [keyed, ids[6], ids[5]]
    seen = [r["id"] for r in page.runs]
    while page.next_before is not None:
        page = app.list_runs(conn, limit=3, before=page.next_before)
        seen += [r["id"] for r in page.runs]
    assert seen == sorted([*ids, keyed], reverse=True)

    assert [r["id"] for r in app.list_runs(conn, Filters(kind="boom")).runs] == [keyed]
    assert [r["id"] for r in app.list_runs(conn, Filters(key="acct-7")).runs] == [keyed]
    tenanted = [r["id"] for r in app.list_runs(conn, Filters(tenant="t1")).runs]
    assert tenanted == [ids[5], ids[3], ids[1]]
    queued = app.list_runs(conn, Filters(statuses=["queued"])).runs
    assert len(queued) == 8
    assert app.list_runs(conn, Filters(statuses=["failed"])).runs == []
    now = operations.db_now(conn)
    assert len(app.list_runs(conn, Filters(since=now - timedelta(hours=1))).runs) == 8
    assert app.list_runs(conn, Filters(since=now + timedelta(hours=1))).runs == []
    with pytest.raises(ConfigError, match="limit"):
        app.list_runs(conn, limit=0)


def test_parse_since() -> None:
    from datetime import UTC, datetime

    now = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    assert operations.parse_since("2h", now) == now - timedelta(hours=2)
    assert operations.parse_since("90s", now) == now - timedelta(seconds=90)
    assert operations.parse_since("7d", now) == now - timedelta(days=7)
    assert operations.parse_since("2026-04-30T10:00", now) == datetime(2026, 4, 30, 10, tzinfo=UTC)
    with pytest.raises(ConfigError, match="--since 'yesterday'"):
        operations.parse_since("yesterday", now)


def test_retry_a_failed_run_gets_a_fresh_budget_and_keeps_its_history(
    conn: Conn, make_worker: Callable[..., Worker]
) -> None:
    app = make_app()
    run_id = fail_for_good(conn, app, make_worker)
    before = get_run(conn, run_id)
    assert before["attempts"] == 2 and len(before["history"]) == 2

    acted = app.retry(conn, [run_id])
    assert acted.ids == [run_id]
    after = get_run(conn, run_id)
    assert after["status"] == "queued" and after["finished_at"] is None
    assert after["error"] is None and after["cancel_requested_at"] is None
    assert after["attempts"] == 2 and after["max_attempts"] == 4  # two more, the task's figure
    assert after["history"] == before["history"]

    # it runs again: two more attempts, then failed again, the history growing
    worker = make_worker(app)
    for _ in range(2):
        conn.execute(
            "UPDATE leasework.runs SET queued_at = leasework.now() WHERE id = %s", (run_id,)
        )
        worker.poll()
    final = get_run(conn, run_id)
    assert final["status"] == "failed" and final["attempts"] == 4
    assert [h["attempt"] for h in final["history"]] == [1, 2, 3, 4]


def test_retry_by_filter_and_with_explicit_attempts(
    conn: Conn, make_worker: Callable[..., Worker]
) -> None:
    app = make_app()
    a = fail_for_good(conn, app, make_worker)
    b = fail_for_good(conn, app, make_worker)
    done = app.enqueue(conn, "ok")
    make_worker(app).poll()
    assert get_run(conn, done)["status"] == "succeeded"
    dry = app.retry(conn, filters=Filters(kind="boom", statuses=["failed"]), dry_run=True)
    assert dry.dry_run and dry.count == 2 and get_run(conn, a)["status"] == "failed"
    acted = app.retry(conn, filters=Filters(kind="boom", statuses=["failed"]), attempts=5)
    assert acted.ids == [a, b]
    assert get_run(conn, a)["max_attempts"] == 7
    assert get_run(conn, done)["status"] == "succeeded"
    with pytest.raises(ConfigError, match="only failed, cancelled, partial"):
        app.retry(conn, filters=Filters(statuses=["succeeded"]))
    with pytest.raises(ConfigError, match="name run ids, or filters"):
        app.retry(conn, filters=Filters())


def test_retry_and_delete_refuse_bad_input_and_change_nothing(
    conn: Conn, make_worker: Callable[..., Worker]
) -> None:
    app = make_app()
    failed = fail_for_good(conn, app, make_worker)
    queued = app.enqueue(conn, "ok")
    running = app.enqueue(conn, "ok", key="busy")
    claim = lease.claim_runs(conn, ["ok"], worker="w", lease=30)
    assert [c.id for c in claim] == [queued]
    claim2 = lease.claim_runs(conn, ["ok"], worker="w", lease=30)
    assert [c.id for c in claim2] == [running]
    before = snapshot(conn)
    with pytest.raises(ConfigError, match="no run with id 424242"):
        app.retry(conn, [failed, 424242])
    # a state conflict is StateConflict, not ConfigError (bad input); nothing changes either way
    with pytest.raises(StateConflict, match=f"run {queued} is running: only a finished run"):
        app.retry(conn, [failed, queued])
    with pytest.raises(StateConflict, match=f"run {running} is running"):
        app.delete(conn, [failed, running])
    with pytest.raises(ConfigError, match="no run with id 424242"):
        app.delete(conn, [424242])
    with pytest.raises(ConfigError, match="positive integer"):
        app.delete(conn, [0])
    with pytest.raises(ConfigError, match="only succeeded, partial, failed, cancelled"):
        app.delete(conn, filters=Filters(statuses=["running"]))
    assert snapshot(conn) == before


def test_retry_refuses_a_run_whose_key_is_busy(
    conn: Conn, make_worker: Callable[..., Worker]
) -> None:
    app = make_app()
    failed = fail_for_good(conn, app, make_worker, key="acct-1")
    busy = app.enqueue_run(conn, "ok", key="acct-1")
    assert busy.existing is False
    before = snapshot(conn)
    with pytest.raises(StateConflict, match="key 'acct-1' already has a queued or running run"):
        app.retry(conn, [failed])
    assert snapshot(conn) == before


def test_retry_looks_at_the_key_in_the_runs_own_tenant(
    conn: Conn, make_worker: Callable[..., Worker]
) -> None:
    """A key is its tenant's: another tenant's active run of the key, or an untenanted one, does
    not keep a run from its retry, and runs of one key in two tenants retry together; the run's
    own tenant's active run of the key does keep it, and names the tenant."""
    app = make_app()
    a = fail_for_good(conn, app, make_worker, key="acct-1", tenant="a")
    b = fail_for_good(conn, app, make_worker, key="acct-1", tenant="b")
    app.enqueue(conn, "ok", key="acct-1")
    app.enqueue(conn, "ok", key="acct-1", tenant="c")
    assert app.retry(conn, [a, b]).ids == [a, b]
    assert app.cancel(conn, b) == "cancelled"
    app.enqueue(conn, "ok", key="acct-1", tenant="b")
    before = snapshot(conn)
    with pytest.raises(StateConflict, match="key 'acct-1' in tenant 'b' already has a queued or"):
        app.retry(conn, [b])
    assert snapshot(conn) == before


def test_delete_finished_runs_by_id_and_filter(
    conn: Conn, make_worker: Callable[..., Worker]
) -> None:
    app = make_app()
    failed = fail_for_good(conn, app, make_worker)
    oks = [app.enqueue(conn, "ok") for _ in range(3)]
    make_worker(app).poll()
    live = app.enqueue(conn, "ok")
    assert app.delete(conn, [failed], dry_run=True).count == 1
    assert get_run(conn, failed)["status"] == "failed"
    assert app.delete(conn, [failed]).ids == [failed]
    assert operations.get_run(conn, failed) is None
    assert app.delete(conn, filters=Filters(kind="ok"), dry_run=True).count == 3
    assert app.delete(conn, filters=Filters(kind="ok")).ids == oks
    assert get_run(conn, live)["status"] == "queued"


def test_pause_and_resume(conn: Conn, make_worker: Callable[..., Worker]) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "ok")
    batch = [app.enqueue(conn, "batchy") for _ in range(3)]
    assert app.pause(conn, "ok", "batchy") == ["batchy", "ok"]
    assert app.pause(conn, "ok") == []  # already paused: left as it is
    assert [p["kind"] for p in operations.paused(conn)] == ["batchy", "ok"]
    assert operations.get_run(conn, run_id)["kind_paused"] is True  # type: ignore[index]
    worker = make_worker(app)
    worker.poll()
    assert get_run(conn, run_id)["status"] == "queued"
    assert {get_run(conn, b)["status"] for b in batch} == {"queued"}
    assert app.resume(conn, "ok", "batchy") == ["batchy", "ok"]
    worker.poll()
    assert get_run(conn, run_id)["status"] == "succeeded"
    assert {get_run(conn, b)["status"] for b in batch} == {"succeeded"}


def test_pause_and_resume_refuse_an_unknown_kind_and_resume_leaves_one_not_paused(conn: Conn) -> None:
    app = make_app()
    with pytest.raises(ConfigError, match="unknown kind 'nope'"):
        app.pause(conn, "ok", "nope")
    assert operations.paused(conn) == []
    # a kind the database has seen (a run of it) may be paused without the app
    app.enqueue(conn, "ok")
    assert operations.pause(conn, ["ok"]) == ["ok"]
    # resume is idempotent, as pause is: a kind the app knows but that is not paused is left
    # as it is; a kind nothing knows is refused (a typo), and nothing is resumed
    with pytest.raises(ConfigError, match=r"unknown kind 'nope': .* nothing resumed"):
        app.resume(conn, "ok", "nope")
    assert [p["kind"] for p in operations.paused(conn)] == ["ok"]
    assert app.resume(conn, "ok", "boom") == ["ok"]
    assert app.resume(conn, "ok", "boom") == []
    assert operations.paused(conn) == []
    with pytest.raises(ConfigError, match="unknown kind 'boom'"):
        operations.resume(conn, ["boom"])  # without the app, nothing has seen boom


def test_a_paused_kinds_running_run_finishes(
    conn: Conn, make_worker: Callable[..., Worker]
) -> None:
    app = App()
    paused_meanwhile: list[bool] = []

    @app.task("slow")
    def slow(ctx: Context, payload: Any) -> Any:
        with psycopg.connect(conn.info.dsn, autocommit=True) as other:
            operations.pause(other, ["slow"])
        paused_meanwhile.append(True)
        return "done"

    run_id = app.enqueue(conn, "slow")
    make_worker(app).poll()
    assert paused_meanwhile == [True]
    assert get_run(conn, run_id)["status"] == "succeeded"


@pytest.mark.parametrize("tenant", TENANTS)
def test_a_paused_kind_is_never_claimed(conn: Conn, tenant: str | None) -> None:
    paused_kind_is_never_claimed(conn, tenant)


def test_counters_only_go_up_across_retry_delete_and_prune(
    conn: Conn, make_worker: Callable[..., Worker]
) -> None:
    """What finished runs counted moves to leasework.counters when they are retried or deleted,
    so the totals /metrics reports never go down."""
    app = make_app()

    def totals() -> dict[tuple[str, str, str], float]:
        rows = conn.execute(
            """SELECT kind, 'finished', status, count(*)::float8 FROM leasework.runs
                WHERE finished_at IS NOT NULL GROUP BY 1, 2, 3"""
        ).fetchall()
        out: dict[tuple[str, str, str], float] = {}
        for k, n, label, v in rows:
            out[(k, n, label)] = out.get((k, n, label), 0) + v
        for k, n, label, v in conn.execute(
            "SELECT kind, name, label, value FROM leasework.counters WHERE name = 'finished'"
        ).fetchall():
            out[(k, n, label)] = out.get((k, n, label), 0) + v
        return out

    failed = fail_for_good(conn, app, make_worker)
    assert totals() == {("boom", "finished", "failed"): 1}
    app.retry(conn, [failed])
    assert totals() == {("boom", "finished", "failed"): 1}
    fail_again = make_worker(app)
    for _ in range(2):
        conn.execute(
            "UPDATE leasework.runs SET queued_at = leasework.now() WHERE id = %s", (failed,)
        )
        fail_again.poll()
    assert totals() == {("boom", "finished", "failed"): 2}
    app.delete(conn, [failed])
    assert totals() == {("boom", "finished", "failed"): 2}
    buckets = conn.execute(
        "SELECT sum(value) FROM leasework.counters WHERE name = 'duration' AND kind = 'boom'"
    ).fetchone()
    assert buckets is not None and buckets[0] == 2
    # a lost lease, counted when its run is pruned
    held = app.enqueue(conn, "ok")
    assert [c.id for c in lease.claim_runs(conn, ["ok"], worker="w", lease=30)] == [held]
    expire_lease(conn, held)
    make_worker(app).poll()
    assert get_run(conn, held)["status"] == "succeeded"
    shift_clock(conn, 10 * 86400)
    conn.execute("DELETE FROM leasework.runs WHERE id = %s", (held,))
    lost = conn.execute(
        "SELECT name, label, value FROM leasework.counters WHERE kind = 'ok' AND name IN "
        "('lost', 'reclaimed') ORDER BY 1"
    ).fetchall()
    assert lost == [("lost", "expired", 1.0), ("reclaimed", "", 1.0)]
