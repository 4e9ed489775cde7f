"""An enqueue whose payload cannot be bound to the handler's parameters is refused, before
anything is written, rather than accepted and failed at every attempt: by the App that knows
the task (enqueue, enqueue_many, the typed `.enqueue`, sync and awaited), and by
leasework.enqueue itself for the kinds whose workers declared what their handlers take
(leasework.kinds.accepts), which is what a Client or a SQL caller meets."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from leasework import App, Client, PayloadError
from leasework.stages.maintenance import MaintenanceStage
from leasework.tasks import Accepts

Conn = psycopg.Connection[Any]


@dataclasses.dataclass
class Report:
    week: int
    fmt: str = "pdf"


def make_app() -> App:
    app = App()

    @app.task("kw")
    def kw(ctx: Any, *, week: int, fmt: str = "pdf") -> None: ...

    @app.task("kw.any")
    def kw_any(ctx: Any, *, week: int, **rest: Any) -> None: ...

    @app.task("plain")
    def plain(ctx: Any, payload: Any) -> None: ...

    @app.task("model")
    def model(ctx: Any, payload: Report) -> None: ...

    @app.task("akw")
    async def akw(ctx: Any, *, week: int) -> None: ...

    return app


def runs(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) FROM leasework.runs").fetchone()
    return int(row[0]) if row else 0


BAD = [
    ("kw", [1, 2], "the payload is a JSON array, not an object"),
    ("kw", "week 48", "the payload is a JSON string, not an object"),
    ("kw", {"wek": 48}, "the payload has an unexpected key 'wek' (did you mean 'week'?)"),
    ("kw", {"fmt": "csv"}, "the payload has no key 'week'"),
    ("kw", {"week": 48, "fromat": "csv"}, "the payload has an unexpected key 'fromat' (did you mean 'fmt'?)"),
    ("kw", None, "the payload has no key 'week'"),
    ("kw.any", {"other": 1}, "the payload has no key 'week'"),
    ("model", {"week": 1, "colour": "red"}, "the payload has an unexpected key 'colour'"),
    ("model", {}, "the payload has no key 'week'"),
    ("akw", 7, "the payload is a JSON number, not an object"),
]


@pytest.mark.parametrize(("kind", "payload", "wrong"), BAD)
def test_enqueue_refuses_a_payload_the_handler_cannot_take(
    conn: Conn, kind: str, payload: Any, wrong: str
) -> None:
    app = make_app()
    with pytest.raises(PayloadError) as caught:
        app.enqueue(conn, kind, payload)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"task {kind!r} cannot take this payload: {wrong}")
    assert "its handler takes" in message and "week" in message
    with pytest.raises(PayloadError):
        app.enqueue_many(conn, kind, [{"week": 1}, payload])
    assert runs(conn) == 0, "nothing is written"


def test_the_message_says_what_the_handler_takes(conn: Conn) -> None:
    app = make_app()
    with pytest.raises(PayloadError, match=r"keyword arguments: a JSON object with week, fmt "
                       r"\(optional\)$"):
        app.enqueue(conn, "kw", [])
    with pytest.raises(PayloadError, match=r"\(payload 1\)"):
        app.enqueue_many(conn, "kw", [{"week": 1}, {"week": 2, "x": 1}])


GOOD = [
    ("kw", {"week": 48}),
    ("kw", {"week": 48, "fmt": "csv"}),
    ("kw.any", {"week": 48, "anything": [1]}),
    ("plain", [1, 2]),
    ("plain", "a string"),
    ("plain", None),
    ("model", {"week": 1}),
    ("model", 17),  # not an object: passed to the handler as it is
    ("akw", {"week": 1}),
]


@pytest.mark.parametrize(("kind", "payload"), GOOD)
def test_a_payload_the_handler_can_take_is_enqueued(conn: Conn, kind: str, payload: Any) -> None:
    app = make_app()
    assert app.enqueue(conn, kind, payload) > 0
    assert len(app.enqueue_many(conn, kind, [payload, payload])) == 2
    assert runs(conn) == 3


def test_the_typed_enqueue_and_the_awaited_ones_refuse_too(dsn: str, conn: Conn) -> None:
    app = make_app()
    kw = app.tasks["kw"]
    assert kw.accepts.spread and kw.accepts.required == ("week",)
    typed = App()

    @typed.task("typed")
    def typed_task(ctx: Any, *, week: int) -> None: ...

    with pytest.raises(TypeError):
        typed_task.enqueue(conn, wek=48)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        typed_task.enqueue(conn)  # type: ignore[call-arg]
    assert typed_task.enqueue(conn, week=48) > 0

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            with pytest.raises(PayloadError, match="not an object"):
                await app.enqueue_async(aconn, "kw", [48])
            with pytest.raises(PayloadError, match="unexpected key 'wk'"):
                await app.enqueue_run_async(aconn, "kw", {"wk": 48})
            with pytest.raises(PayloadError, match=r"\(payload 0\)"):
                await app.enqueue_many_async(aconn, "akw", ["x"])
            assert await app.enqueue_async(aconn, "akw", {"week": 1}) > 0

    asyncio.run(main())
    assert runs(conn) == 2


def test_a_debounce_merge_that_makes_a_bad_payload_is_refused(conn: Conn) -> None:
    app = App()

    @app.task("merged", debounce=60, debounce_merge=lambda old, new: [old, new])
    def merged(ctx: Any, *, week: int) -> None: ...

    app.enqueue(conn, "merged", {"week": 1}, key="k")
    with pytest.raises(PayloadError, match="debounce_merge"):
        app.enqueue(conn, "merged", {"week": 2}, key="k")
    (payload,) = conn.execute("SELECT payload FROM leasework.runs").fetchone()
    assert payload == {"week": 1}


# -- leasework.enqueue: what the kind's workers declared ----------------------------------------


def declare(conn: Conn, app: App) -> None:
    """What a worker of `app` records at its first poll (MaintenanceStage._declare)."""
    stage = next(s for s in app.stages() if isinstance(s, MaintenanceStage))
    stage._declare(conn)


def test_workers_declare_what_each_handler_takes(conn: Conn) -> None:
    declare(conn, make_app())
    got = dict(conn.execute("SELECT kind, accepts FROM leasework.kinds").fetchall())
    assert got["plain"] == {"takes": "any"}
    assert got["kw"]["takes"] == "keywords"
    assert got["kw"]["required"] == ["week"] and got["kw"]["allowed"] == ["week", "fmt"]
    assert got["kw.any"]["allowed"] is None
    assert got["model"]["takes"] == "fields"
    # a worker that declares a kind without saying what it takes keeps the recorded shape
    MaintenanceStage(make_app().config, kinds=["kw"])._declare(conn)
    (kept,) = conn.execute("SELECT accepts FROM leasework.kinds WHERE kind = 'kw'").fetchone()
    assert kept == got["kw"]


SQL_BAD = [
    ("kw", "[48]", "task 'kw' cannot take this payload: the payload is a JSON array, not an object"),
    ("kw", "{}", "task 'kw' cannot take this payload: the payload has no key 'week'"),
    ("kw", '{"week": 1, "fromat": 2}', "the payload has an unexpected key 'fromat'"),
    ("kw", "null", "the payload has no key 'week'"),  # stored as {}, as Python stores None
    ("model", '{"week": 1, "x": 2}', "the payload has an unexpected key 'x'"),
]


@pytest.mark.parametrize(("kind", "payload", "wrong"), SQL_BAD)
def test_sql_enqueue_refuses_what_the_declared_handler_cannot_take(
    conn: Conn, kind: str, payload: str, wrong: str
) -> None:
    declare(conn, make_app())
    with pytest.raises(psycopg.errors.InvalidParameterValue) as caught:
        conn.execute("SELECT leasework.enqueue(%s, %s::jsonb)", (kind, payload))
    message = caught.value.diag.message_primary or ""
    assert wrong in message and "its handler takes" in message, message
    assert caught.value.sqlstate == "22023"
    assert runs(conn) == 0


def test_sql_enqueue_takes_what_the_handler_can_and_any_undeclared_kind(conn: Conn) -> None:
    declare(conn, make_app())
    for kind, payload in [
        ("kw", '{"week": 1}'),
        ("kw.any", '{"week": 1, "more": true}'),
        ("plain", "[1]"),
        ("model", '"as it is"'),
        ("never.declared", "[1]"),
    ]:
        conn.execute("SELECT leasework.enqueue(%s, %s::jsonb)", (kind, payload))
    assert runs(conn) == 5


def test_a_client_without_the_handlers_is_refused_by_the_database(conn: Conn) -> None:
    """A web process enqueueing with a Client knows no handler; the kind's workers declared it."""
    declare(conn, make_app())
    client = Client()
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="unexpected key 'wek'"):
        client.enqueue(conn, "kw", {"wek": 48})
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="no key 'week'"):
        client.enqueue(conn, "kw", {"fmt": "csv"})
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="not an object"):
        client.enqueue(conn, "kw", [48], key="k")  # the keyed path, too
    assert client.enqueue(conn, "kw", {"week": 48}) > 0
    assert runs(conn) == 1


def test_the_cli_refuses_it_in_one_line_and_exits_2(conn: Conn, tmp_path: Path, dsn: str) -> None:
    (tmp_path / "shapesapp.py").write_text(
        "from leasework import App\n\napp = App()\n\n\n"
        "@app.task('kw')\ndef kw(ctx, *, week):\n    return week\n",
        encoding="utf-8",
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LEASEWORK_", "PG")) and k != "DATABASE_URL"
    }
    done = subprocess.run(
        [sys.executable, "-m", "leasework", "enqueue", "kw", "--app", "shapesapp:app",
         "--payload", '{"wek": 48}', "--dsn", dsn],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "task 'kw' cannot take this payload" in lines[0], done.stderr
    assert "did you mean 'week'?" in lines[0]
    assert runs(conn) == 0


# -- Python and SQL agree -----------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "c", "week"])
shapes = st.builds(
    Accepts,
    spread=st.booleans(),
    model=st.sampled_from([None, "Model"]),
    required=st.lists(NAMES, unique=True, max_size=2).map(tuple),
    optional=st.lists(NAMES, unique=True, max_size=2).map(tuple),
    extra=st.booleans(),
).filter(lambda a: not set(a.required) & set(a.optional))
# Text jsonb can hold: no NUL, no lone surrogate (an enqueue refuses either before it is sent).
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=3),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(NAMES, inner, max_size=3),
    max_leaves=6,
)


def _verdict(problem: str | None) -> str | None:
    """What kind of problem, whichever key each side happened to name first."""
    if problem is None:
        return None
    for kind in ("not an object", "unexpected key", "no key"):
        if kind in problem:
            return kind
    return problem


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(shapes, st.lists(json_values, min_size=1, max_size=10))
def test_python_and_sql_give_the_same_verdict(
    conn: Conn, accepts: Accepts, payloads: list[Any]
) -> None:
    rows = conn.execute(
        "SELECT leasework.payload_problem('k', coalesce(nullif(p, 'null'), '{}'), %s)"
        "  FROM unnest(%s::jsonb[]) WITH ORDINALITY AS u(p, i) ORDER BY i",
        (Jsonb(accepts.declared()), [Jsonb(p) for p in payloads]),
    ).fetchall()
    for payload, (sql_problem,) in zip(payloads, rows, strict=True):
        python = accepts.problem(payload)
        assert _verdict(sql_problem) == _verdict(python), (accepts, payload, sql_problem, python)
        if python is not None and sql_problem is not None and "unexpected" not in python:
            assert f"cannot take this payload: {python}; its handler takes" in sql_problem
