"""Connection syncs and purges on real Postgres, the seed's integration test made real: the real
modules, the real `files` connector (or a stub standing in only for an upstream API), and
`worker.poll()` called directly."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from leasework import Aborted, App, ConfigError, Fail, Retry, Snooze
from leasework.syncs.connectors import Connection, Table, TableError
from leasework.workers.context import Context

from ..conftest import expire_lease, get_run, make_due
from .syncing import (
    connection_row,
    live,
    poll_until,
    records,
    rows,
    runs_of,
    sync_app,
    syncs,
    tombstoned,
    write_csv,
    write_jsonl,
)

Conn = psycopg.Connection[Any]


def files_app() -> App:
    return sync_app()


def only_run(conn: Conn, connection_id: int, kind: str = "sync") -> dict[str, Any]:
    found = runs_of(conn, connection_id, kind)
    assert len(found) == 1, found
    return found[0]


# -- 1. claimed, executed, published; tombstones; reappearing rows ----------------------------


def test_sync_publishes_tombstones_and_revives(
    conn: Conn, make_worker: Any, tmp_path: Path
) -> None:
    write_jsonl(
        tmp_path,
        "projects",
        [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}, {"id": 3, "name": "c"}],
    )
    write_csv(tmp_path, "tasks", ["id", "title"], [["t1", "dig"], ["t2", "pour"]])
    app = files_app()
    cid = syncs(app).connect(conn, workspace="ws", provider="files", config={"path": str(tmp_path)})
    first = only_run(conn, cid)
    assert first["status"] == "queued"
    key = f"leasework:connection:{cid}"
    assert (first["tenant"], first["group"], first["key"]) == ("ws", "files", key)

    worker = make_worker(app, sync_batch=2)  # several batches per table
    assert worker.poll() >= 1
    run = get_run(conn, first["id"])
    assert run["status"] == "succeeded", run
    assert run["attempts"] == 1
    tables = run["result"]["tables"]
    assert tables["projects"] == {
        "status": "ok",
        "upserted": 3,
        "tombstoned": 0,
        "error": None,
        "retryable": None,
        "attempt": 1,
    }
    assert tables["tasks"]["upserted"] == 2
    assert live(conn, cid) == {
        ("projects", "1"),
        ("projects", "2"),
        ("projects", "3"),
        ("tasks", "t1"),
        ("tasks", "t2"),
    }
    assert records(conn, cid)[("tasks", "t1")]["data"] == {"id": "t1", "title": "dig"}
    first_seen = records(conn, cid)[("projects", "2")]["first_seen_at"]

    # Upstream changes: project 2 disappears, project 3 changes, task t2 disappears.
    write_jsonl(tmp_path, "projects", [{"id": 1, "name": "a"}, {"id": 3, "name": "c2"}])
    write_csv(tmp_path, "tasks", ["id", "title"], [["t1", "dig"]])
    second = syncs(app).sync_now(conn, cid)
    assert second != first["id"]
    worker.poll()
    run = get_run(conn, second)
    assert run["status"] == "succeeded"
    assert run["result"]["tables"]["projects"]["tombstoned"] == 1
    assert run["result"]["tables"]["tasks"]["tombstoned"] == 1
    assert tombstoned(conn, cid) == {("projects", "2"), ("tasks", "t2")}
    assert records(conn, cid)[("projects", "3")]["data"]["name"] == "c2"

    # Project 2 reappears: live again, first_seen_at kept.
    write_jsonl(
        tmp_path,
        "projects",
        [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}, {"id": 3, "name": "c2"}],
    )
    third = syncs(app).sync_now(conn, cid)
    worker.poll()
    assert get_run(conn, third)["status"] == "succeeded"
    assert tombstoned(conn, cid) == {("tasks", "t2")}
    again = records(conn, cid)[("projects", "2")]
    assert again["deleted_at"] is None and again["first_seen_at"] == first_seen


def test_a_removed_file_tombstones_its_table_and_a_failed_table_is_kept(
    conn: Conn, make_worker: Any, tmp_path: Path
) -> None:
    """The files connector lists every table there is: a file that is gone is a table that was
    removed upstream. A table that failed to read tombstones nothing."""
    write_jsonl(tmp_path, "projects", [{"id": 1}, {"id": 2}])
    write_jsonl(tmp_path, "tasks", [{"id": "t1"}])
    write_jsonl(tmp_path, "people", [{"id": "p1"}])
    app = files_app()
    cid = syncs(app).connect(conn, workspace="ws", provider="files", config={"path": str(tmp_path)})
    worker = make_worker(app)
    worker.poll()
    assert len(live(conn, cid)) == 4

    (tmp_path / "tasks.jsonl").unlink()
    (tmp_path / "people.jsonl").write_text("not json\n", encoding="utf-8")
    run_id = syncs(app).sync_now(conn, cid)
    worker.poll()
    run = get_run(conn, run_id)
    assert run["status"] == "partial", run  # people failed, not retryable
    assert run["result"]["tables"]["tasks"]["tombstoned"] == 1
    assert run["result"]["tables"]["tasks"]["removed_upstream"] is True
    assert tombstoned(conn, cid) == {("tasks", "t1")}
    assert live(conn, cid) == {("projects", "1"), ("projects", "2"), ("people", "p1")}


def test_connect_refuses_bad_input(conn: Conn) -> None:
    app = files_app()
    with pytest.raises(ConfigError, match="unknown provider"):
        syncs(app).connect(conn, workspace="ws", provider="nope")
    with pytest.raises(ConfigError, match="path"):
        syncs(app).connect(conn, workspace="ws", provider="files", config={})
    with pytest.raises(ConfigError, match="every"):
        syncs(app).connect(conn, workspace="ws", provider="files", config={"path": "/x"}, every=0)
    with pytest.raises(ConfigError, match="no connection"):
        syncs(app).sync_now(conn, 12345)
    assert conn.execute("SELECT count(*) FROM leasework.connections").fetchone() == (0,)


# -- 2. retried in place ---------------------------------------------------------------------


def stub_app(extract: Any, provider: str = "stub") -> App:
    app = sync_app()
    syncs(app).connector(provider)(extract)
    return app


def test_failed_extraction_is_retried_in_place(conn: Conn, make_worker: Any) -> None:
    def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
        raise RuntimeError("upstream said 500")
        yield  # pragma: no cover

    app = stub_app(extract)
    cid = syncs(app).connect(conn, workspace="ws", provider="stub")
    run_id = only_run(conn, cid)["id"]
    make_worker(app).poll()
    run = get_run(conn, run_id)
    assert only_run(conn, cid)["id"] == run_id  # the same row, no new run
    assert run["status"] == "queued"
    assert run["attempts"] == 1
    requeued_at = run["history"][-1]["ended_at"]
    assert run["history"][-1]["outcome"] == "failed"
    delay = (run["queued_at"] - _ts(conn, requeued_at)).total_seconds()
    assert 4.0 <= delay <= 6.0, delay  # 5 s x 0.8-1.2
    assert "upstream said 500" in run["error"]


def _ts(conn: Conn, text: str) -> Any:
    row = conn.execute("SELECT %s::timestamptz", (text,)).fetchone()
    assert row is not None
    return row[0]


def test_retry_after_wins_and_published_tables_are_kept(conn: Conn, make_worker: Any) -> None:
    def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
        yield Table("accounts", rows(3))
        raise Retry(after=90, message="429 Too Many Requests")

    app = stub_app(extract)
    cid = syncs(app).connect(conn, workspace="ws", provider="stub")
    run_id = only_run(conn, cid)["id"]
    make_worker(app).poll()
    run = get_run(conn, run_id)
    assert (run["status"], run["attempts"]) == ("queued", 1)
    delay = (run["queued_at"] - _ts(conn, run["history"][-1]["ended_at"])).total_seconds()
    assert 89.0 <= delay <= 91.0, delay
    assert run["result"]["tables"]["accounts"]["upserted"] == 3  # kept across the retry
    assert len(live(conn, cid)) == 3


def test_a_connector_snoozes_without_charging_an_attempt_and_keeps_its_tables(
    conn: Conn, make_worker: Any
) -> None:
    def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
        yield Table("accounts", rows(2))
        raise Snooze(after=3600, reason="the provider's sync window opens at 02:00")

    app = stub_app(extract)
    cid = syncs(app).connect(conn, workspace="ws", provider="stub")
    run_id = only_run(conn, cid)["id"]
    make_worker(app).poll()
    run = get_run(conn, run_id)
    assert (run["status"], run["attempts"], run["snoozes"]) == ("queued", 0, 1)
    assert run["history"][-1]["outcome"] == "snoozed" and run["error"] is None
    assert run["result"]["tables"]["accounts"]["upserted"] == 2  # kept across the snooze
    assert len(live(conn, cid)) == 2


def test_a_connector_fails_the_sync_at_once(conn: Conn, make_worker: Any) -> None:
    def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
        raise Fail("the account was closed upstream")
        yield  # pragma: no cover

    app = stub_app(extract)
    cid = syncs(app).connect(conn, workspace="ws", provider="stub")
    run_id = only_run(conn, cid)["id"]
    make_worker(app).poll()
    run = get_run(conn, run_id)
    assert (run["status"], run["attempts"]) == ("failed", 1)
    assert run["error"] == "Fail: the account was closed upstream"


# -- 3. delete while a sync runs: the purge waits, is promoted, drains -------------------------


def test_delete_while_sync_running_purge_waits_then_drains(conn: Conn, make_worker: Any) -> None:
    seen: dict[str, Any] = {}

    def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
        yield Table("items", rows(5))
        purge_id = syncs(app).delete_connection(conn, connection.id)
        seen["purge"] = purge_id
        seen["purge_status"] = get_run(conn, purge_id)["status"]
        seen["connection_status"] = connection_row(conn, connection.id)["status"]  # type: ignore[index]
        yield Table("more", rows(1, prefix="m"))  # the sync drains: it still publishes

    app = stub_app(extract)
    cid = syncs(app).connect(conn, workspace="ws", provider="stub")
    sync_id = only_run(conn, cid)["id"]
    worker = make_worker(app, sync_batch=2)
    worker.poll()
    assert seen["purge_status"] == "waiting"
    assert seen["connection_status"] == "deleting"
    assert get_run(conn, sync_id)["status"] == "succeeded"
    assert len(live(conn, cid)) == 6
    assert get_run(conn, seen["purge"])["status"] in ("waiting", "queued")
    # A second delete returns the pending purge; a sync_now is refused.
    assert syncs(app).delete_connection(conn, cid) == seen["purge"]
    with pytest.raises(ConfigError, match="deleting"):
        syncs(app).sync_now(conn, cid)

    worker.poll()  # settle promotes the purge; the claim executes it
    purge = get_run(conn, seen["purge"])
    assert purge["status"] == "succeeded", purge
    assert purge["exclusive"] is True
    assert purge["result"] == {
        "connection_id": cid,
        "deleted_records": 6,
        "connection_deleted": True,
    }
    assert connection_row(conn, cid) is None
    assert records(conn, cid) == {}


def test_delete_idle_connection_purges_at_once(
    conn: Conn, make_worker: Any, tmp_path: Path
) -> None:
    write_jsonl(tmp_path, "t", rows(3))
    app = files_app()
    cid = syncs(app).connect(conn, workspace="ws", provider="files", config={"path": str(tmp_path)})
    worker = make_worker(app)
    worker.poll()
    assert len(live(conn, cid)) == 3
    purge_id = syncs(app).delete_connection(conn, cid)
    assert get_run(conn, purge_id)["status"] == "queued"
    worker.poll()
    assert get_run(conn, purge_id)["status"] == "succeeded"
    assert connection_row(conn, cid) is None


def test_delete_cancels_a_queued_sync(conn: Conn, make_worker: Any, tmp_path: Path) -> None:
    app = files_app()
    cid = syncs(app).connect(conn, workspace="ws", provider="files", config={"path": str(tmp_path)})
    sync_id = only_run(conn, cid)["id"]
    purge_id = syncs(app).delete_connection(conn, cid)
    assert get_run(conn, sync_id)["status"] == "cancelled"
    assert get_run(conn, purge_id)["status"] == "queued"  # nothing to drain behind
    make_worker(app).poll()
    assert connection_row(conn, cid) is None


# -- the requeue re-checks the world ------------------------------------------------------------


@pytest.mark.parametrize("how", ["exception", "retryable_table", "retry_after"])
def test_sync_requeued_after_delete_ends_cancelled(conn: Conn, make_worker: Any, how: str) -> None:
    def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
        yield Table("ok", rows(2))
        syncs(app).delete_connection(conn, connection.id)
        if how == "exception":
            raise RuntimeError("upstream 503")
        if how == "retry_after":
            raise Retry(after=30)
        yield Table("flaky", error=TableError("503 on /flaky", retryable=True))

    app = stub_app(extract)
    cid = syncs(app).connect(conn, workspace="ws", provider="stub")
    sync_id = only_run(conn, cid)["id"]
    worker = make_worker(app)
    worker.poll()
    run = get_run(conn, sync_id)
    assert run["status"] == "cancelled", run
    assert run["attempts"] == 1
    assert "deleting" in run["result"]["cancelled"]
    assert run["result"]["tables"]["ok"]["upserted"] == 2
    worker.poll()  # the purge is promoted and drains
    assert connection_row(conn, cid) is None


def test_sync_of_a_disconnected_connection_ends_cancelled(conn: Conn, make_worker: Any) -> None:
    calls: list[int] = []

    def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
        calls.append(ctx.attempt)
        if len(calls) == 1:
            raise RuntimeError("boom")
        yield Table("t", rows(1))

    app = stub_app(extract)
    cid = syncs(app).connect(conn, workspace="ws", provider="stub")
    sync_id = only_run(conn, cid)["id"]
    worker = make_worker(app)
    worker.poll()
    assert get_run(conn, sync_id)["status"] == "queued"
    # Disconnected while the retry waits: cancelled now (the claim-time check would too).
    assert syncs(app).disconnect(conn, cid) == "disconnected"
    assert get_run(conn, sync_id)["status"] == "cancelled"
    # A sync enqueued behind the API's back (without the connection's key, which is reserved)
    # is cancelled when claimed, without calling upstream.
    stray = app.enqueue(conn, "sync", {"connection_id": cid}, tenant="ws", group="stub")
    worker.poll()
    assert get_run(conn, stray)["status"] == "cancelled"
    assert calls == [1]
    with pytest.raises(ConfigError, match="disconnected"):
        syncs(app).sync_now(conn, cid)
    assert syncs(app).reconnect(conn, cid) == "active"
    syncs(app).sync_now(conn, cid)
    worker.poll()
    assert len(live(conn, cid)) == 1


# -- partial results -------------------------------------------------------------------------


def test_non_retryable_table_failure_seals_partial(
    conn: Conn, make_worker: Any, tmp_path: Path
) -> None:
    write_jsonl(tmp_path, "good", rows(3))
    write_jsonl(tmp_path, "broken", rows(2, prefix="b"))
    app = files_app()
    cid = syncs(app).connect(conn, workspace="ws", provider="files", config={"path": str(tmp_path)})
    worker = make_worker(app)
    worker.poll()
    assert len(live(conn, cid)) == 5

    # `broken` becomes unreadable (not JSON) and `good` loses a row.
    (tmp_path / "broken.jsonl").write_text('{"id": "b1"}\nnot json\n', encoding="utf-8")
    write_jsonl(tmp_path, "good", rows(2))
    run_id = syncs(app).sync_now(conn, cid)
    worker.poll()
    run = get_run(conn, run_id)
    assert run["status"] == "partial", run
    assert run["attempts"] == 1  # not retried
    tables = run["result"]["tables"]
    assert tables["good"]["status"] == "ok" and tables["good"]["tombstoned"] == 1
    assert tables["broken"]["status"] == "failed" and tables["broken"]["retryable"] is False
    assert "line 2" in tables["broken"]["error"]
    assert "broken" in run["error"]
    # The failed table tombstoned nothing; the other table was published.
    assert tombstoned(conn, cid) == {("good", "r3")}
    assert {k for k in live(conn, cid) if k[0] == "broken"} == {("broken", "b1"), ("broken", "b2")}


def test_retryable_table_failure_retries_then_seals_partial(conn: Conn, make_worker: Any) -> None:
    def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
        yield Table("steady", rows(2))
        yield Table("flaky", error=TableError("endpoint briefly unavailable", retryable=True))

    app = stub_app(extract)
    cid = syncs(app).connect(conn, workspace="ws", provider="stub")
    run_id = only_run(conn, cid)["id"]
    worker = make_worker(app)
    worker.poll()
    run = get_run(conn, run_id)
    assert (run["status"], run["attempts"]) == ("queued", 1)
    assert run["result"]["tables"]["flaky"]["status"] == "failed"
    for attempt in (2, 3):
        make_due(conn, run_id)
        worker.poll()
        assert get_run(conn, run_id)["attempts"] == attempt
    run = get_run(conn, run_id)
    # The last attempt seals what it got rather than failing the whole run.
    assert run["status"] == "partial"
    assert run["result"]["tables"]["steady"]["attempt"] == 3
    assert [h["outcome"] for h in run["history"]] == ["partial", "partial", "partial"]


# -- fencing ---------------------------------------------------------------------------------


def test_stale_worker_publish_writes_nothing(conn: Conn, make_worker: Any) -> None:
    """Worker A stalls after extracting; its lease expires and B syncs the connection. When A
    wakes and publishes, its fenced transaction writes nothing and A records no outcome."""
    outcome: dict[str, Any] = {}

    def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
        if ctx.attempt == 1:
            expire_lease(conn, ctx.run_id)
            outcome["b"] = worker_b.poll()  # B reclaims the run and completes it meanwhile
            yield Table("t", [{"id": "x", "by": "stale A"}, {"id": "y", "by": "stale A"}])
        else:
            yield Table("t", [{"id": "x", "by": "B"}])

    app = stub_app(extract)
    cid = syncs(app).connect(conn, workspace="ws", provider="stub")
    run_id = only_run(conn, cid)["id"]
    worker_a = make_worker(app)
    worker_b = make_worker(app)
    worker_a.poll()
    assert outcome["b"] >= 1
    run = get_run(conn, run_id)
    assert run["status"] == "succeeded"
    assert run["attempts"] == 2
    assert run["lease_worker"] == worker_b.id  # the worker of its successful attempt
    assert {k: r["data"]["by"] for k, r in records(conn, cid).items()} == {("t", "x"): "B"}
    outcomes = [h["outcome"] for h in run["history"]]
    assert outcomes == ["expired", "succeeded"]


# -- one run per connection, the rate limiter, exclusive purges --------------------------------


def test_racing_sync_now_gives_one_run(conn: Conn, dsn: str, tmp_path: Path) -> None:
    app = files_app()
    cid = syncs(app).connect(
        conn, workspace="ws", provider="files", config={"path": str(tmp_path)}, sync=False
    )
    barrier = threading.Barrier(3)
    ids: list[int] = []
    lock = threading.Lock()

    def racer() -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            barrier.wait(timeout=10)
            run_id = syncs(app).sync_now(c, cid)
            with lock:
                ids.append(run_id)

    threads = [threading.Thread(target=racer) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert len(ids) == 3 and len(set(ids)) == 1
    assert len(runs_of(conn, cid)) == 1


LIVE_LEASES = """
SELECT count(*) FROM leasework.runs
 WHERE tenant = %s AND "group" = %s AND status = 'running' AND lease_expires_at >= leasework.now()
"""


def test_limiter_same_provider_never_overlaps_different_providers_do(
    conn: Conn, dsn: str, make_worker: Any
) -> None:
    """Two `alpha` connections and one `beta` connection in one workspace, three workers."""
    lock = threading.Lock()
    active: dict[str, int] = {"alpha": 0, "beta": 0}
    peak: dict[str, int] = {"alpha": 0, "beta": 0}
    overlapped = threading.Event()
    live_leases: list[int] = []

    def extractor(provider: str, other: str) -> Any:
        def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
            with lock:
                active[provider] += 1
                peak[provider] = max(peak[provider], active[provider])
            try:
                with psycopg.connect(dsn, autocommit=True) as c:
                    row = c.execute(LIVE_LEASES, ("ws", provider)).fetchone()
                    assert row is not None
                    live_leases.append(row[0])
                # Hold the lease for a while; a run of the other provider should join us.
                deadline = time.monotonic() + 1.0
                while time.monotonic() < deadline:
                    with lock:
                        if active[other] > 0:
                            overlapped.set()
                    ctx.check()
                    time.sleep(0.01)
                yield Table("t", rows(1, prefix=provider))
            finally:
                with lock:
                    active[provider] -= 1

        return extract

    app = sync_app()
    syncs(app).connector("alpha")(extractor("alpha", "beta"))
    syncs(app).connector("beta")(extractor("beta", "alpha"))
    a1 = syncs(app).connect(conn, workspace="ws", provider="alpha")
    a2 = syncs(app).connect(conn, workspace="ws", provider="alpha")
    b1 = syncs(app).connect(conn, workspace="ws", provider="beta")
    workers = [make_worker(app) for _ in range(3)]

    def done() -> bool:
        row = conn.execute(
            "SELECT count(*) FROM leasework.runs WHERE kind = 'sync' AND status = 'succeeded'"
        ).fetchone()
        return row is not None and row[0] == 3

    poll_until(workers, done)
    assert peak["alpha"] == 1, peak  # same provider, same workspace: never at once
    assert overlapped.is_set()  # different providers: in parallel
    assert live_leases and max(live_leases) == 1
    for cid in (a1, a2, b1):
        assert len(live(conn, cid)) == 1


def _intervals(conn: Conn, tenant: str) -> list[tuple[int, str, Any, Any]]:
    """(run id, kind, started, ended) of every attempt of every run of a tenant."""
    out = []
    for run in conn.execute(
        "SELECT id, kind, leasework.run_history(r) FROM leasework.runs r WHERE tenant = %s",
        (tenant,),
    ).fetchall():
        for h in run[2]:
            out.append((run[0], run[1], _ts(conn, h["started_at"]), _ts(conn, h["ended_at"])))
    return out


def test_purge_never_overlaps_another_run_of_its_workspace(
    conn: Conn, make_worker: Any, tmp_path: Path
) -> None:
    def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
        deadline = time.monotonic() + 0.4
        while time.monotonic() < deadline:
            ctx.check()
            time.sleep(0.01)
        yield Table("t", rows(2))

    app = sync_app()
    syncs(app).connector("alpha")(extract)
    syncs(app).connector("beta")(extract)
    write_jsonl(tmp_path, "t", rows(4))
    victim = syncs(app).connect(
        conn, workspace="ws", provider="files", config={"path": str(tmp_path)}
    )
    workers = [make_worker(app) for _ in range(3)]
    workers[0].poll()  # the victim's first sync
    assert len(live(conn, victim)) == 4
    # Two syncs of other providers, then the purge, then one more sync behind it.
    s1 = syncs(app).connect(conn, workspace="ws", provider="alpha")
    s2 = syncs(app).connect(conn, workspace="ws", provider="beta")
    purge_id = syncs(app).delete_connection(conn, victim)
    s3 = syncs(app).connect(conn, workspace="ws", provider="alpha")

    def done() -> bool:
        row = conn.execute(
            "SELECT count(*) FROM leasework.runs WHERE tenant = 'ws' AND finished_at IS NULL"
        ).fetchone()
        return row is not None and row[0] == 0

    poll_until(workers, done)
    assert get_run(conn, purge_id)["status"] == "succeeded"
    for cid in (s1, s2, s3):
        assert only_run(conn, cid)["status"] == "succeeded"
    spans = _intervals(conn, "ws")
    purge_spans = [s for s in spans if s[0] == purge_id]
    assert purge_spans
    for _, _, p_start, p_end in purge_spans:
        for run_id, _, start, end in spans:
            if run_id != purge_id:
                assert end <= p_start or start >= p_end, (purge_spans, spans)
    # And the syncs of different providers did overlap each other (the limiter allows it).
    sync_spans = [s for s in spans if s[1] == "sync" and s[0] != purge_id]
    assert any(
        a[2] < b[3] and b[2] < a[3] for a in sync_spans for b in sync_spans if a[0] != b[0]
    ), sync_spans


# -- the abort signal ----------------------------------------------------------------------------


def test_cancel_trips_the_signal_the_connector_sees(conn: Conn, make_worker: Any) -> None:
    seen: dict[str, Any] = {}

    def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
        yield Table("first", rows(2))
        app.cancel(conn, ctx.run_id)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                ctx.check()
                time.sleep(0.01)
        except Aborted as exc:
            seen["reason"] = exc.reason
            raise
        yield Table("never", rows(1))

    app = stub_app(extract)
    cid = syncs(app).connect(conn, workspace="ws", provider="stub")
    run_id = only_run(conn, cid)["id"]
    make_worker(app, control_interval=0.05).poll()
    run = get_run(conn, run_id)
    assert seen["reason"] == "cancelled"
    assert run["status"] == "cancelled"
    assert run["result"]["tables"]["first"]["upserted"] == 2  # kept on cancel
    assert ("never", "r1") not in live(conn, cid)


def test_status_and_listing_show_connections(conn: Conn, make_worker: Any, tmp_path: Path) -> None:
    from leasework import status
    from leasework.syncs.kinds import list_connections

    write_jsonl(tmp_path, "projects", rows(2))
    app = files_app()
    cid = syncs(app).connect(
        conn, workspace="ws", provider="files", config={"path": str(tmp_path)}, every=900
    )
    make_worker(app).poll()
    listed = list_connections(conn)
    assert [(c["id"], c["live_records"], c["status"]) for c in listed] == [(cid, 2, "active")]
    snap = status.collect(conn)
    (entry,) = snap["connections"]
    assert entry["id"] == cid
    assert entry["last_run_status"] == "succeeded"
    assert entry["tables"]["projects"]["upserted"] == 2
    assert entry["next_run_at"] is not None
    text = status.render(snap)
    assert "connections:" in text and "projects" in text
    section = text[text.index("connections:") :]
    assert all(len(line) <= 80 for line in section.splitlines())


def _spin(ctx: Context, seen: dict[str, Any]) -> None:
    """Wait upstream, listening to the abort signal as a connector should."""
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            ctx.check()
            time.sleep(0.01)
    except Aborted as exc:
        seen["reason"] = exc.reason
        raise


def test_timeout_trips_the_signal_and_retries(conn: Conn, make_worker: Any) -> None:
    seen: dict[str, Any] = {}

    def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
        yield Table("first", rows(1))
        _spin(ctx, seen)

    app = stub_app(extract)
    worker = make_worker(app, sync_timeout=0.3)
    cid = syncs(worker.app).connect(conn, workspace="ws", provider="stub")
    run_id = only_run(conn, cid)["id"]
    worker.poll()
    run = get_run(conn, run_id)
    assert seen["reason"] == "timeout"
    assert (run["status"], run["attempts"]) == ("queued", 1)
    assert run["history"][-1]["outcome"] == "timeout"
    assert run["result"]["tables"]["first"]["upserted"] == 1


def test_lost_lease_trips_the_signal_and_writes_nothing(conn: Conn, make_worker: Any) -> None:
    seen: dict[str, Any] = {}

    def extract(ctx: Context, connection: Connection) -> Iterator[Table]:
        # Another worker took the run over (its owner token is not ours any more).
        conn.execute(
            "UPDATE leasework.runs SET lease_owner = gen_random_uuid() WHERE id = %s", (ctx.run_id,)
        )
        _spin(ctx, seen)
        yield Table("never", rows(1))

    app = stub_app(extract)
    cid = syncs(app).connect(conn, workspace="ws", provider="stub")
    run_id = only_run(conn, cid)["id"]
    make_worker(app, control_interval=0.05).poll()
    assert seen["reason"] == "lost"
    run = get_run(conn, run_id)
    assert run["status"] == "running" and run["history"] == []  # the stale worker wrote nothing
    assert records(conn, cid) == {}
