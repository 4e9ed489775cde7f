"""An enqueue without options reuses the parameters it made for its kind (client._Plain) while
the kind's defaults and the configuration are the same objects: each payload is still checked
against the handler and the size cap, and a change of a kind's defaults is seen at the next
enqueue."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from leasework import App, Client, Config, ConfigError, KindDefaults, PayloadError

Conn = psycopg.Connection[Any]


def attempts_of(conn: Conn, run_id: int) -> tuple[Any, ...] | None:
    return conn.execute(
        "SELECT max_attempts, timeout_seconds, payload FROM leasework.runs WHERE id = %s",
        (run_id,),
    ).fetchone()


def test_each_payload_is_checked_again(conn: Conn) -> None:
    app = App(Config(payload_max_bytes=64))

    @app.task("mail", max_attempts=5)
    def mail(ctx: Any, *, to: str) -> None:
        return None

    first = app.enqueue(conn, "mail", {"to": "a"})
    assert attempts_of(conn, first) == (5, 3600.0, {"to": "a"})
    with pytest.raises(PayloadError, match="unexpected key 'too'"):
        app.enqueue(conn, "mail", {"too": "b"})
    with pytest.raises(PayloadError, match="64"):
        app.enqueue(conn, "mail", {"to": "x" * 100})
    second = app.enqueue(conn, "mail", {"to": "c"})
    assert attempts_of(conn, second) == (5, 3600.0, {"to": "c"})
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (2,)


def test_a_kinds_new_defaults_are_seen(conn: Conn) -> None:
    client = Client(kinds={"report": KindDefaults(max_attempts=4, timeout=60)})
    first = client.enqueue(conn, "report", {"n": 1})
    client.kind_defaults["report"] = KindDefaults(max_attempts=7, timeout=90)
    second = client.enqueue(conn, "report", {"n": 2})
    del client.kind_defaults["report"]
    third = client.enqueue(conn, "report", {"n": 3})
    assert attempts_of(conn, first) == (4, 60.0, {"n": 1})
    assert attempts_of(conn, second) == (7, 90.0, {"n": 2})
    assert attempts_of(conn, third) == (3, 3600.0, {"n": 3})


def test_options_after_a_plain_enqueue_are_checked(conn: Conn) -> None:
    app = App()
    app.task("k")(lambda ctx, p: None)
    app.enqueue(conn, "k", {})
    with pytest.raises(ConfigError, match="priority"):
        app.enqueue(conn, "k", {}, priority=2**40)
    with pytest.raises(TypeError, match="unexpected keyword"):
        app.enqueue(conn, "k", {}, prio=1)  # type: ignore[call-arg]
    run = app.enqueue(conn, "k", None, priority=-3)
    found = conn.execute("SELECT priority, payload FROM leasework.runs WHERE id = %s", (run,))
    assert found.fetchone() == (-3, {})
