"""App.enqueue and App.cancel in the caller's own transaction: refused input writes nothing, and
a run commits or rolls back with the caller's effects."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from leasework import App, ConfigError, PayloadError, UnknownKind
from leasework.app import DEFAULT_TIMEOUT

Conn = psycopg.Connection[Any]


def make() -> App:
    app = App(App().config.replace(payload_max_bytes=64))
    app.task("job")(lambda ctx, payload: None)
    return app


def count(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) FROM leasework.runs").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"kind": "nosuch"}, UnknownKind, "unknown kind .nosuch.; known kinds: .*job"),
        ({"payload": {"x": "y" * 100}}, PayloadError, "over the cap"),
        ({"payload": {"x": object()}}, PayloadError, "JSON"),
        ({"payload": {"x": "a\x00b"}}, PayloadError, "NUL"),
        ({"key": ""}, ConfigError, "key"),
        ({"tenant": "x" * 201}, ConfigError, "tenant"),
        ({"group": "a\nb"}, ConfigError, "group"),
        ({"priority": 2**31}, ConfigError, "priority"),
        ({"priority": True}, ConfigError, "priority"),
        ({"delay": -1}, ConfigError, "delay"),
        ({"delay": float("nan")}, ConfigError, "delay"),
        ({"max_attempts": 0}, ConfigError, "max_attempts"),
    ],
)
def test_refused_input_writes_nothing(
    conn: Conn, kwargs: dict[str, Any], error: type[Exception], needle: str
) -> None:
    app = make()
    args = {"kind": "job", "payload": {}, **kwargs}
    with pytest.raises(error, match=needle) as caught:
        app.enqueue(conn, args.pop("kind"), args.pop("payload"), **args)
    assert "\n" not in str(caught.value)
    assert count(conn) == 0
    assert conn.execute("SELECT count(*) FROM leasework.tenants").fetchone() == (0,)


def test_enqueue_rolls_back_with_the_callers_transaction(conn: Conn) -> None:
    app = make()
    with pytest.raises(RuntimeError), conn.transaction():
        app.enqueue(conn, "job", key="k", tenant="ws")
        raise RuntimeError("the caller's effect failed")
    assert count(conn) == 0
    with conn.transaction():
        run_id = app.enqueue(conn, "job", key="k", tenant="ws")
    assert count(conn) == 1 and app.enqueue(conn, "job", key="k", tenant="ws") == run_id


def test_task_registration_is_validated() -> None:
    app = App()
    with pytest.raises(ConfigError, match="kind"):
        app.task("has space")
    with pytest.raises(ConfigError, match="max_attempts"):
        app.task("x", max_attempts=0)
    with pytest.raises(ConfigError, match="lease"):
        app.task("x", lease=0)
    with pytest.raises(ConfigError, match="timeout"):
        app.task("x", timeout=-1)
    app.task("x")(lambda ctx, payload: None)
    with pytest.raises(ConfigError, match="twice"):
        app.task("x")(lambda ctx, payload: None)


def test_per_task_settings_reach_the_run(conn: Conn) -> None:
    app = App()
    app.task("slow", max_attempts=7, lease=300, timeout=60)(lambda ctx, payload: None)
    run_id = app.enqueue(conn, "slow")
    row = conn.execute(
        "SELECT max_attempts, lease_seconds, timeout_seconds FROM leasework.runs WHERE id = %s",
        (run_id,),
    ).fetchone()
    assert row == (7, 300.0, 60.0)
    assert app.enqueue(conn, "slow", max_attempts=2) != run_id


def test_a_task_times_out_after_an_hour_unless_it_says_otherwise(conn: Conn) -> None:
    app = App()
    app.task("plain")(lambda ctx, payload: None)
    app.task("endless", timeout=None)(lambda ctx, payload: None)
    timeouts = {
        kind: conn.execute(
            "SELECT timeout_seconds FROM leasework.runs WHERE id = %s",
            (app.enqueue(conn, kind),),
        ).fetchone()
        for kind in ("plain", "endless")
    }
    assert timeouts == {"plain": (DEFAULT_TIMEOUT,), "endless": (None,)}
    assert DEFAULT_TIMEOUT == 3600.0
