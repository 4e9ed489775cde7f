"""A run of a kind no worker has a handler for (enqueued by a Client or from SQL) is never
claimed, and once it has waited unknown_kind_after the maintenance stage ends it `failed` with
one line naming the kinds the workers know. A kind that another app's workers declared is left
for them; unknown_kind_after = 0 turns the rule off. Time is moved, never slept."""

from __future__ import annotations

from typing import Any

import psycopg

from leasework import App, Client, Context

Conn = psycopg.Connection[Any]


def app_of(*kinds: str) -> App:
    app = App()
    for kind in kinds:
        app.task(kind)(lambda ctx, payload: None)
    return app


def age(conn: Conn, run_id: int, seconds: float) -> None:
    """The run has been due for `seconds`, and every maintenance period has passed."""
    conn.execute(
        "UPDATE leasework.runs SET queued_at = leasework.now() - make_interval(secs => %s) "
        "WHERE id = %s",
        (seconds, run_id),
    )
    conn.execute("UPDATE leasework.maintenance SET last_run_at = last_run_at - interval '1 day'")


def status(conn: Conn, run_id: int) -> tuple[Any, ...]:
    found = conn.execute(
        "SELECT status, error, attempts, finished_at IS NOT NULL FROM leasework.runs WHERE id = %s",
        (run_id,),
    ).fetchone()
    assert found is not None
    return found


def test_an_unknown_kind_is_left_queued_then_failed_in_one_line(
    conn: Conn, make_worker: Any
) -> None:
    worker = make_worker(app_of("b.report", "a.send"))
    typo = Client().enqueue(conn, "a.sned", {"x": 1})
    worker.poll()  # declares its kinds; claims nothing of a.sned
    assert conn.execute("SELECT kind FROM leasework.kinds ORDER BY kind").fetchall() == [
        ("a.send",),
        ("b.report",),
    ]
    assert status(conn, typo) == ("queued", None, 0, False)
    age(conn, typo, 1800)  # half the default hour: still waiting
    worker.poll()
    assert status(conn, typo)[0] == "queued"
    age(conn, typo, 3700)
    worker.poll()
    state, error, attempts, finished = status(conn, typo)
    assert (state, attempts, finished) == ("failed", 0, True)
    assert error == (
        "unknown kind 'a.sned': no worker has a handler for it (workers know a.send, b.report); "
        "register it with @app.task('a.sned') and retry the run"
    )


def test_kinds_of_another_app_are_left_for_its_workers(conn: Conn, make_worker: Any) -> None:
    ours = make_worker(app_of("ours"))
    theirs = make_worker(app_of("theirs"))
    theirs.poll()  # its workers declared "theirs" (and then went quiet, say)
    run_id = Client().enqueue(conn, "theirs")
    age(conn, run_id, 7200)
    ours.poll()
    assert status(conn, run_id)[0] == "queued"
    # a kind no worker declared for over seven days is unknown again
    conn.execute(
        "UPDATE leasework.kinds SET seen_at = now() - interval '8 days' WHERE kind = 'theirs'"
    )
    age(conn, run_id, 7200)
    ours.poll()
    state, error, *_ = status(conn, run_id)
    assert state == "failed" and "(workers know ours)" in error


def test_unknown_kind_after_zero_never_fails_a_run(conn: Conn, make_worker: Any) -> None:
    worker = make_worker(app_of("known"), unknown_kind_after=0)
    run_id = Client().enqueue(conn, "nobody")
    age(conn, run_id, 30 * 86400)
    worker.poll()
    assert status(conn, run_id)[0] == "queued"


def test_a_known_kind_waiting_long_is_never_failed_by_the_rule(
    conn: Conn, make_worker: Any
) -> None:
    app = App()
    seen: list[int] = []

    @app.task("slow.queue")
    def handler(ctx: Context, payload: Any) -> None:
        seen.append(ctx.run_id)

    run_id = app.enqueue(conn, "slow.queue", delay=0)
    app.pause(conn, "slow.queue")  # paused for a day: known, so left alone
    worker = make_worker(app)
    age(conn, run_id, 86400)
    worker.poll()
    assert status(conn, run_id)[0] == "queued" and seen == []
    app.resume(conn, "slow.queue")
    worker.poll()
    assert status(conn, run_id)[0] == "succeeded" and seen == [run_id]
