"""Bulk enqueue: COPY without keys, one INSERT ... unnest with keys."""

from __future__ import annotations

import pytest

from leasework import App, UnknownKind


def _app() -> App:
    app = App()

    @app.task("bulk")
    def bulk(ctx, payload):
        return payload

    return app


def test_copy_path_inserts_in_order_and_runs(conn, make_worker):
    app = _app()
    with conn.transaction():
        ids = app.enqueue_many(conn, "bulk", [{"i": i} for i in range(50)], tenant="t1", group="g")
    assert len(ids) == 50 and len(set(ids)) == 50
    rows = conn.execute(
        "SELECT id, payload, tenant, status FROM leasework.runs ORDER BY id"
    ).fetchall()
    assert [r[0] for r in rows] == sorted(ids)
    assert {r[0]: r[1]["i"] for r in rows} == {run_id: i for i, run_id in enumerate(ids)}
    assert {r[2] for r in rows} == {"t1"} and {r[3] for r in rows} == {"queued"}
    assert (
        conn.execute("SELECT count(*) FROM leasework.tenants WHERE name = 't1'").fetchone()[0] == 1
    )
    # a run enqueued one at a time afterwards gets a fresh id
    assert app.enqueue(conn, "bulk", {}) not in ids
    worker = make_worker(app, runs_limit=100)
    worker.poll()
    assert (
        conn.execute("SELECT count(*) FROM leasework.runs WHERE status = 'succeeded'").fetchone()[0]
        == 51
    )


def test_keys_skip_active_duplicates(conn):
    app = _app()
    first = app.enqueue(conn, "bulk", {}, key="k1")
    ids = app.enqueue_many(conn, "bulk", [{"a": 1}, {"a": 2}, {"a": 3}], keys=["k1", "k2", None])
    assert len(ids) == 2 and first not in ids
    keys = conn.execute("SELECT key FROM leasework.runs ORDER BY id").fetchall()
    assert [k[0] for k in keys] == ["k1", "k2", None]


def test_bad_input_writes_nothing(conn):
    app = _app()
    with pytest.raises(UnknownKind):
        app.enqueue_many(conn, "nope", [{}])
    with pytest.raises(Exception, match="keys"):
        app.enqueue_many(conn, "bulk", [{}, {}], keys=["a"])
    with pytest.raises(Exception, match="JSON"):
        app.enqueue_many(conn, "bulk", [{}, {1: object()}])
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone()[0] == 0
