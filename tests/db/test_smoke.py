"""End to end through one poll: enqueue, claim, execute, record."""

from __future__ import annotations

from leasework import App

from ..conftest import get_run


def test_enqueue_poll_succeeds(conn, make_worker):
    app = App()

    @app.task("hello")
    def hello(ctx, payload):
        ctx.check()
        return {"hi": payload["name"]}

    run_id = app.enqueue(conn, "hello", {"name": "x"})
    worker = make_worker(app)
    assert worker.poll() >= 1
    row = get_run(conn, run_id)
    assert row["status"] == "succeeded"
    assert row["result"] == {"hi": "x"}
    assert row["attempts"] == 1
    assert [h["outcome"] for h in row["history"]] == ["succeeded"]
