"""@app.task refuses handlers the worker cannot run (generators) in one line and registers
nothing, and takes `async def` ones (and callables whose call is async) for the async stage; the handle it returns is the handler, callable as written, and the executor
calls a keyword-only handler with the payload's keys."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

from leasework import App, ConfigError, Context, Task, TaskHandle


async def coro(ctx: Context, payload: Any) -> None: ...


def gen(ctx: Context, payload: Any) -> Any:
    yield payload


async def agen(ctx: Context, payload: Any) -> Any:
    yield payload


class AsyncCallable:
    async def __call__(self, ctx: Context, payload: Any) -> None: ...


@pytest.mark.parametrize(
    ("fn", "what"),
    [(gen, "a generator function"), (agen, "an async generator function")],
)
def test_a_handler_that_would_return_without_running_is_refused(fn: Any, what: str) -> None:
    app = App()
    with pytest.raises(ConfigError) as info:
        app.task("x")(fn)
    message = str(info.value)
    assert "task 'x': handler " in message and f" is {what}; handlers must be functions" in message
    assert "async def handler(ctx, payload)" in message and "\n" not in message
    assert app.tasks == {}  # nothing registered
    with pytest.raises(ConfigError, match=what):
        app.register(Task("y", fn))
    assert app.tasks == {}


@pytest.mark.parametrize(
    "fn", [coro, functools.wraps(coro)(lambda ctx, p: coro(ctx, p)), AsyncCallable()]
)
def test_async_handlers_go_to_the_async_stage_and_are_awaited(fn: Any) -> None:
    app = App()
    app.task("x")(fn)
    assert app.tasks["x"].stage == "async"
    run = app.handler("x")
    assert asyncio.run(run(None, {"a": 1})) is None


def test_the_handle_is_the_handler_and_keyword_handlers_get_the_payload_spread() -> None:
    app = App()

    @app.task("spread")
    def spread(ctx: Context, *, week: int, final: bool = False) -> tuple[int, bool]:
        return week, final

    @app.task("plain")
    def plain(ctx: Context, payload: dict[str, Any]) -> dict[str, Any]:
        return payload

    assert isinstance(spread, TaskHandle) and spread.__name__ == "spread"
    assert spread(None, week=3) == (3, False)  # type: ignore[arg-type]
    run = app.handler("spread")
    assert run(None, {"week": 4, "final": True}) == (4, True)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"task 'spread' takes keyword arguments \(week, final\): its payload must be a JSON object, got list",
    ):
        run(None, [1])  # type: ignore[arg-type]
    assert app.handler("plain") is plain.fn  # unchanged: called as fn(ctx, payload)
    assert app.handler("plain")(None, {"a": 1}) == {"a": 1}  # type: ignore[arg-type]


def test_a_bare_task_decorator_says_the_kind_is_missing() -> None:
    app = App()
    with pytest.raises(ConfigError, match=r"@app.task needs the kind: write @app.task\('send'\)"):

        @app.task  # type: ignore[arg-type]
        def send(ctx: Context, payload: Any) -> None: ...

    assert not app.tasks


def test_a_misspelt_keyword_of_the_typed_enqueue_is_named() -> None:
    app = App()

    @app.task("report")
    def report(ctx: Context, *, week: int, region: str = "eu") -> None: ...

    with pytest.raises(TypeError, match=r"unexpected keyword argument 'wek' \(did you mean 'week'\?\); it takes week, region"):
        report.enqueue(None, wek=48)  # type: ignore[arg-type, call-arg]
