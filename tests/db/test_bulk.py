"""Bulk actions, search and tags from Python (leasework.operations, App, Client, SQL): cancel and
run-now by ids and by filter, a page of runs per transaction (a run claimed between pages is
cancelled as running), retry and delete by filter paged too; a state conflict raises
StateConflict, not ConfigError; error-text, payload and tag searches; tags on every enqueue
(App.enqueue, enqueue_many by COPY and with keys, the typed .enqueue, leasework.enqueue in SQL),
checked with the label rule."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import errors as pgerrors

from leasework import App, ConfigError, Context, StateConflict, operations
from leasework.errors import NotFound
from leasework.leases import lease
from leasework.operations import Acted, Filters
from leasework.workers.worker import Worker

from ..conftest import get_run

Conn = psycopg.Connection[Any]


def make_app() -> App:
    app = App()

    @app.task("bulk")
    def bulk(ctx: Context, payload: Any) -> Any:
        return None

    @app.task("boom", max_attempts=1)
    def boom(ctx: Context, payload: Any) -> Any:
        raise RuntimeError(f"HTTP 429 Too Many Requests for account {payload.get('account')}")

    return app


def snapshot(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT * FROM leasework.runs ORDER BY id").fetchall()


def statuses(conn: Conn, ids: list[int]) -> dict[int, tuple[str, bool]]:
    rows = conn.execute(
        "SELECT id, status, cancel_requested_at IS NOT NULL FROM leasework.runs "
        "WHERE id = ANY(%s) ORDER BY id",
        (ids,),
    ).fetchall()
    return {int(r[0]): (str(r[1]), bool(r[2])) for r in rows}


def drain(worker: Worker, conn: Conn) -> None:
    """Poll until no run is queued and due (a bounded number of polls)."""
    for _ in range(20):
        row = conn.execute(
            "SELECT count(*) FROM leasework.runs WHERE status = 'queued' "
            "AND queued_at <= leasework.now()"
        ).fetchone()
        if row == (0,):
            return
        worker.poll()
    raise AssertionError("runs still queued after 20 polls")


def many(conn: Conn, app: App, n: int, **options: Any) -> list[int]:
    return app.enqueue_many(conn, "bulk", [{"n": i} for i in range(n)], **options)


# -- cancel ---------------------------------------------------------------------------------------


def test_cancel_several_ids_queued_running_and_finished(conn: Conn) -> None:
    app = make_app()
    running = app.enqueue(conn, "bulk")
    (claim,) = lease.claim_runs(conn, ["bulk"], worker="w", lease=30)
    assert claim.id == running
    queued = app.enqueue(conn, "bulk")
    done = app.enqueue(conn, "bulk")
    assert app.cancel(conn, done) == "cancelled"
    acted = operations.cancel(conn, [queued, running, done])
    assert acted.ids == [queued] and acted.requested == [running] and acted.skipped == [done]
    assert acted.count == 2
    assert statuses(conn, [queued, running, done]) == {
        queued: ("cancelled", True),
        running: ("running", True),
        done: ("cancelled", True),
    }
    assert lease.control(conn, claim) == "cancelled"  # the worker's control check sees it


def test_cancel_an_unknown_id_changes_nothing(conn: Conn) -> None:
    app = make_app()
    ids = many(conn, app, 2)
    before = snapshot(conn)
    with pytest.raises(NotFound, match="no run with id 424242"):
        operations.cancel(conn, [*ids, 424242])
    assert snapshot(conn) == before


def test_cancel_by_filter_needs_a_filter_and_a_live_status(conn: Conn) -> None:
    with pytest.raises(ConfigError, match="name run ids, or filters"):
        operations.cancel(conn, filters=Filters())
    with pytest.raises(ConfigError, match="only blocked, waiting, queued, running runs can be"):
        operations.cancel(conn, filters=Filters(statuses=["failed"]))


def test_a_bulk_cancel_pages_each_page_its_own_transaction(dsn: str, conn: Conn) -> None:
    """1,200 queued runs, pages of 500: three statements, each committed before the next (another
    session sees the first page cancelled while the walk goes on), and a run a worker claims
    between pages is cancelled as running (a request), not as if it were still queued."""
    app = make_app()
    ids = many(conn, app, 1199)
    late = app.enqueue(conn, "bulk", priority=-1)  # the worker below claims it first
    ids.append(late)
    assert len(ids) == 1200 and late == max(ids)
    seen: list[tuple[int, int, Any, int]] = []
    claimed: list[int] = []

    def between(page: int, so_far: Acted) -> None:
        with psycopg.connect(dsn, autocommit=True) as other:
            committed = other.execute(
                "SELECT count(*) FROM leasework.runs WHERE kind = 'bulk' AND status = 'cancelled'"
            ).fetchone()
            assert committed is not None
            seen.append((page, so_far.count, conn.info.transaction_status, int(committed[0])))
            if page == 1:
                (claim,) = lease.claim_runs(other, ["bulk"], worker="w2", lease=30)
                claimed.append(claim.id)

    acted = operations.cancel(
        conn, filters=Filters(kind="bulk"), page_size=500, between_pages=between
    )
    idle = psycopg.pq.TransactionStatus.IDLE
    assert seen == [(1, 500, idle, 500), (2, 1000, idle, 1000), (3, 1200, idle, 1199)]
    assert acted.pages == 3 and acted.count == 1200
    assert claimed == [late] and acted.requested == [late]
    assert statuses(conn, [late]) == {late: ("running", True)}
    assert len(acted.ids) == 1199


def test_a_paged_action_refuses_to_run_inside_a_transaction(conn: Conn) -> None:
    app = make_app()
    many(conn, app, 2)
    with conn.transaction(), pytest.raises(ConfigError, match="outside any transaction"):
        operations.cancel(conn, filters=Filters(kind="bulk"))


# -- run-now --------------------------------------------------------------------------------------


def test_run_now_makes_delayed_runs_due_and_refuses_other_states(
    conn: Conn, make_worker: Callable[..., Worker]
) -> None:
    app = make_app()
    later = app.enqueue(conn, "bulk", delay=3600)
    due = app.enqueue(conn, "bulk")
    failed = app.enqueue(conn, "boom", {"account": 1})
    drain(make_worker(app), conn)
    assert get_run(conn, failed)["status"] == "failed"
    assert get_run(conn, due)["status"] == "succeeded"
    other = app.enqueue(conn, "bulk", delay=600)
    before = snapshot(conn)
    with pytest.raises(StateConflict, match=f"run {failed} is failed: only queued runs"):
        operations.run_now(conn, [later, failed])
    assert snapshot(conn) == before
    assert operations.run_now(conn, [later], dry_run=True).count == 1
    acted = operations.run_now(conn, [later])
    assert acted.ids == [later]
    assert operations.held_back(conn, later) == []
    assert [r["reason"] for r in operations.held_back(conn, other)] == ["not_due"]
    by_filter = operations.run_now(conn, filters=Filters(kind="bulk"))
    assert by_filter.ids == [other]
    assert operations.run_now(conn, [other]).skipped == [other]  # due already: left as it is
    drain(make_worker(app), conn)
    assert get_run(conn, later)["status"] == "succeeded"


def test_retrying_a_queued_run_is_a_state_conflict_naming_run_now(conn: Conn) -> None:
    app = make_app()
    queued = app.enqueue(conn, "bulk", delay=60)
    with pytest.raises(StateConflict, match="leasework run-now") as caught:
        app.retry(conn, [queued])
    assert not isinstance(caught.value, ConfigError)


# -- retry and delete by filter, paged -------------------------------------------------------------


def test_retry_and_delete_by_filter_walk_pages(conn: Conn) -> None:
    app = make_app()
    ids = many(conn, app, 7)
    conn.execute(
        "UPDATE leasework.runs SET status = 'failed', finished_at = now(), error = 'x' "
        "WHERE id = ANY(%s)",
        (ids,),
    )
    pages: list[int] = []
    acted = operations.retry(
        conn, filters=Filters(kind="bulk"), page_size=3, between_pages=lambda p, _: pages.append(p)
    )
    assert acted.ids == ids and pages == [1, 2, 3] and acted.pages == 3
    conn.execute(
        "UPDATE leasework.runs SET status = 'succeeded', finished_at = now() WHERE id = ANY(%s)",
        (ids,),
    )
    gone = operations.delete(conn, filters=Filters(kind="bulk"), page_size=2)
    assert gone.ids == ids and gone.pages == 4
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (0,)


def test_retry_by_filter_skips_a_run_whose_key_is_busy(conn: Conn) -> None:
    app = make_app()
    a = app.enqueue(conn, "bulk", key="acct-1")
    b = app.enqueue(conn, "bulk", key="acct-2")
    conn.execute(
        "UPDATE leasework.runs SET status = 'failed', finished_at = now() WHERE id = ANY(%s)",
        ([a, b],),
    )
    busy = app.enqueue(conn, "bulk", key="acct-1")
    acted = app.retry(conn, filters=Filters(kind="bulk", statuses=["failed"]))
    assert acted.ids == [b] and acted.skipped == [a]
    assert get_run(conn, busy)["status"] == "queued" and get_run(conn, a)["status"] == "failed"


# -- search ----------------------------------------------------------------------------------------


def test_search_by_error_text_payload_and_tags(
    conn: Conn, make_worker: Callable[..., Worker]
) -> None:
    app = make_app()
    forty_two = app.enqueue(conn, "boom", {"account": 42, "region": "eu"}, tags=["billing"])
    seven = app.enqueue(conn, "boom", {"account": 7}, tags=["billing", "eu"])
    plain = app.enqueue(conn, "bulk", {"account": 42}, tags=["eu"])
    odd = app.enqueue(conn, "bulk", {"note": "100%_done"})
    drain(make_worker(app), conn)
    conn.execute(
        "UPDATE leasework.runs SET status = 'failed', finished_at = now(), "
        "error = %s WHERE id = %s",
        ("disk 100%_full", odd),
    )

    def found(**kw: Any) -> list[int]:
        return sorted(r["id"] for r in operations.list_runs(conn, Filters(**kw)).runs)

    assert found(error="too many requests") == [forty_two, seven]  # case-insensitive
    assert found(error="account 42") == [forty_two]
    assert found(error="100%_") == [odd]  # % and _ are literal
    assert found(error="100%x") == []
    assert found(payload={"account": 42}) == [forty_two, plain]
    assert found(payload={"account": 42, "region": "eu"}) == [forty_two]
    assert found(tags=["billing"]) == [forty_two, seven]
    assert found(tags=["billing", "eu"]) == [seven]
    assert found(tags=["eu"], payload={"account": 42}) == [plain]
    assert found(kind="boom", error="429", tags=["eu"]) == [seven]
    assert operations.count(conn, Filters(error="429"), "retry") == 2
    assert operations.count_matching(conn, Filters(tags=["eu"])) == 2
    acted = app.retry(conn, filters=Filters(error="429", payload={"account": 7}))
    assert acted.ids == [seven]
    row = operations.list_runs(conn, Filters(tags=["billing", "eu"])).runs[0]
    assert row["tags"] == ["billing", "eu"]


def test_search_filters_refuse_bad_values() -> None:
    with pytest.raises(ConfigError, match="error search must be 1-1000 characters"):
        Filters(error="")
    with pytest.raises(ConfigError, match="payload filter must be a JSON value"):
        Filters(payload={"a": object()})
    with pytest.raises(ConfigError, match="contains control characters"):
        Filters(tags=["a\x1bb"])
    with pytest.raises(ConfigError, match="tags must be a list of strings"):
        Filters(tags="billing")


# -- tags on enqueue ---------------------------------------------------------------------------------


def tags_of(conn: Conn, run_id: int) -> Any:
    row = conn.execute("SELECT tags FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return row[0]


def test_tags_on_every_python_enqueue(conn: Conn) -> None:
    app = make_app()
    one = app.enqueue(conn, "bulk", tags=["b", "a", "b"])
    assert tags_of(conn, one) == ["a", "b"]  # distinct, sorted
    assert tags_of(conn, app.enqueue(conn, "bulk")) is None
    assert tags_of(conn, app.enqueue(conn, "bulk", tags=[])) is None
    copied = app.enqueue_many(conn, "bulk", [{}, {}], tags=["batch-7"])
    keyed = app.enqueue_many(conn, "bulk", [{}, {}], keys=["k1", None], tags=["batch-8"])
    assert [tags_of(conn, i) for i in copied + keyed] == [["batch-7"]] * 2 + [["batch-8"]] * 2
    waits = app.enqueue(conn, "bulk", after=[one], tags=["child"])
    assert tags_of(conn, waits) == ["child"] and get_run(conn, waits)["status"] == "blocked"
    windowed = app.enqueue_many(conn, "bulk", [{}], keys=["w1"], unique_for=60, tags=["win"])
    assert tags_of(conn, windowed[0]) == ["win"]
    # a key's existing run is returned with its own tags
    first = app.enqueue(conn, "bulk", key="acct-9", tags=["first"])
    again = app.enqueue_run(conn, "bulk", key="acct-9", tags=["second"])
    assert again.existing and again.run_id == first and tags_of(conn, first) == ["first"]
    # a debounced run takes the latest enqueue's tags with its payload
    d1 = app.enqueue(conn, "bulk", key="deb", debounce=60, tags=["v1"])
    d2 = app.enqueue(conn, "bulk", key="deb", debounce=60, tags=["v2"])
    assert d1 == d2 and tags_of(conn, d1) == ["v2"]


def test_the_typed_enqueue_takes_tags(conn: Conn) -> None:
    app = App()

    @app.task("typed")
    def typed(ctx: Context, payload: dict[str, Any]) -> None:
        return None

    run_id = typed.configure(tags=["typed"]).enqueue(conn, {"x": 1})
    assert tags_of(conn, run_id) == ["typed"]


def test_bad_tags_are_refused_in_one_line_and_nothing_is_written(conn: Conn) -> None:
    app = make_app()
    before = snapshot(conn)
    with pytest.raises(ConfigError, match=r"^tag 2 of 2 contains control characters \(U\+001B"):
        app.enqueue(conn, "bulk", tags=["ok", "bad\x1b[2J"])
    with pytest.raises(ConfigError, match=r"^tag 1 of 1 must be 1-200 characters long"):
        app.enqueue(conn, "bulk", tags=[""])
    with pytest.raises(ConfigError, match=r"^tags: at most 20 per run, got 21"):
        app.enqueue(conn, "bulk", tags=[f"t{i}" for i in range(21)])
    with pytest.raises(ConfigError, match=r"^tags must be a list of strings"):
        app.enqueue(conn, "bulk", tags="billing")  # type: ignore[arg-type]
    assert snapshot(conn) == before


def test_tags_from_sql(conn: Conn) -> None:
    row = conn.execute(
        "SELECT leasework.enqueue('report', '{}', tags => array['b', 'a'])"
    ).fetchone()
    assert row is not None and tags_of(conn, int(row[0])) == ["a", "b"]
    row = conn.execute("SELECT leasework.enqueue('report')").fetchone()
    assert row is not None and tags_of(conn, int(row[0])) is None
    before = snapshot(conn)
    for tags, says in [
        ("array['ok', E'x\\u202ey']", "tag 2 of 2 contains control characters (U+202E"),
        ("array[NULL]::text[]", "tags must not hold NULL"),
        ("array['']", "tag 1 of 1 must be 1-200 characters long"),
        ("(SELECT array_agg(g::text) FROM generate_series(1, 21) g)", "at most 20 per run"),
    ]:
        with pytest.raises(pgerrors.InvalidParameterValue) as caught:
            conn.execute(f"SELECT leasework.enqueue('report', tags => {tags})")
        assert says in str(caught.value)
    assert snapshot(conn) == before


def test_tags_on_the_awaited_enqueues(dsn: str, conn: Conn) -> None:
    app = make_app()

    async def go() -> tuple[int, list[int]]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            one = await app.enqueue_async(aconn, "bulk", tags=["async"])
            copied = await app.enqueue_many_async(aconn, "bulk", [{}, {}], tags=["copied"])
            return one, copied

    one, copied = asyncio.run(go())
    assert tags_of(conn, one) == ["async"]
    assert [tags_of(conn, i) for i in copied] == [["copied"], ["copied"]]
