"""What `@app.task` returns: the handler, still callable as written, plus a typed enqueue of its
kind (`send_report.enqueue(conn, week=48)`, checked by mypy against the handler's own
parameters). Also the checks a handler passes at registration: a plain function or an `async def`
one (no generator), callable as `fn(ctx, payload)` or, when its parameters after `ctx` are
keyword-only, as `fn(ctx, **payload)` (check_signature), and the payloads it can be called with
(`accepts`: what an enqueue checks)."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, Unpack, overload

import psycopg

from .client import Client
from .errors import ConfigError
from .tasks import ANY, Accepts, Enqueued, EnqueueOptions, accept_options, unexpected_keyword
from .workers.context import Context

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
E = TypeVar("E", bound=Enqueued)
Conn = psycopg.Connection[Any]
AConn = psycopg.AsyncConnection[Any]

__all__ = [
    "AsyncTaskRun",
    "Configured",
    "TaskHandle",
    "TaskRun",
    "accepts",
    "check_handler",
    "check_signature",
    "is_async",
    "prepare_handler",
]


def is_async(fn: object) -> bool:
    """Whether `fn` is an `async def` handler (or a callable object with an async __call__)."""
    inner = inspect.unwrap(fn)  # type: ignore[arg-type]
    return inspect.iscoroutinefunction(inner) or inspect.iscoroutinefunction(
        getattr(inner, "__call__", None)  # noqa: B004 - a callable object's async __call__
    )


def check_handler(kind: str, fn: object) -> None:
    """Refuse, in one line, a handler the worker cannot run: not callable, a generator or an
    async generator function (its call returns without running the body)."""
    if not callable(fn):
        raise ConfigError(f"task {kind!r}: the handler must be a function, got {type(fn).__name__}")
    inner = inspect.unwrap(fn)
    name = getattr(inner, "__qualname__", type(inner).__name__)
    what = None
    if inspect.isasyncgenfunction(inner):
        what = "an async generator function"
    elif inspect.isgeneratorfunction(inner):
        what = "a generator function"
    if what is not None:
        raise ConfigError(
            f"task {kind!r}: handler {name} is {what}; handlers must be functions "
            "`def handler(ctx, payload)` or `async def handler(ctx, payload)` that return their "
            "result"
        )


def check_signature(kind: str, fn: Callable[..., Any]) -> None:
    """Refuse, in one line, a handler whose parameters the executor's call cannot fill: it calls
    `fn(ctx, payload)`, or `fn(ctx, **payload)` when the parameters after ctx are keyword-only,
    so `def h(payload)` (no ctx), `def h(ctx)` or a third required parameter would only fail
    when a run comes. A callable without a signature (a builtin) is taken as it is."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    ctx, payload = object(), object()
    try:
        if _shape(fn).keywords:
            sig.bind_partial(ctx)  # the keys are the payload's: only ctx must go positionally
        else:
            sig.bind(ctx, payload)
    except TypeError:
        name = getattr(inspect.unwrap(fn), "__name__", "")
        name = name if name.isidentifier() else "handler"  # a lambda, a partial
        raise ConfigError(
            f"task {kind!r}: handler {name}{sig} cannot be called with (ctx, payload); write "
            f"`def {name}(ctx, payload)`, or keyword-only `def {name}(ctx, *, a, b)` to get the "
            "payload's keys"
        ) from None


@dataclasses.dataclass(frozen=True)
class _Shape:
    """How a handler takes its payload: `keywords` (its parameters after ctx are keyword-only:
    the payload is a JSON object spread into them) or the payload as one argument, turned into
    `model` (a dataclass) when its annotation is one."""

    keywords: bool
    names: tuple[str, ...] = ()
    model: type | None = None


def _shape(fn: Callable[..., Any]) -> _Shape:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an odd callable: taken as fn(ctx, payload)
        return _Shape(False)
    params = list(sig.parameters.values())[1:]  # after ctx
    kinds = {p.kind for p in params}
    if params and kinds <= {inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD}:
        return _Shape(True, tuple(p.name for p in params if p.kind == p.KEYWORD_ONLY))
    if not params:
        return _Shape(False)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve here: no conversion
        hints = {}
    model = hints.get(params[0].name)
    if isinstance(model, type) and dataclasses.is_dataclass(model):
        return _Shape(False, model=model)
    return _Shape(False)


def accepts(fn: Callable[..., Any]) -> Accepts:
    """The payloads `fn` can be called with, as prepare_handler calls it: keyword-only
    parameters after ctx take a JSON object's keys (those without a default required, no other
    unless `**kwargs`); a payload annotated with a dataclass takes an object whose keys fit its
    fields (any other value is passed as it is); `fn(ctx, payload)` takes any JSON."""
    shape = _shape(fn)
    if shape.keywords:
        params = list(inspect.signature(fn).parameters.values())[1:]
        named = [p for p in params if p.kind is p.KEYWORD_ONLY]
        return Accepts(
            spread=True,
            required=tuple(p.name for p in named if p.default is p.empty),
            optional=tuple(p.name for p in named if p.default is not p.empty),
            extra=any(p.kind is p.VAR_KEYWORD for p in params),
        )
    if shape.model is not None:
        fields = [f for f in dataclasses.fields(shape.model) if f.init]
        return Accepts(
            model=shape.model.__name__,
            required=tuple(
                f.name
                for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            ),
            optional=tuple(
                f.name
                for f in fields
                if f.default is not dataclasses.MISSING
                or f.default_factory is not dataclasses.MISSING
            ),
            extra=False,
        )
    return ANY


def prepare_handler(kind: str, fn: Callable[..., Any]) -> Callable[[Any, Any], Any]:
    """What the executor calls, `run(ctx, payload)`, for a checked handler `fn` (a coroutine
    function again when `fn` is one)."""
    check_handler(kind, fn)
    check_signature(kind, fn)
    shape = _shape(fn)
    if is_async(fn):
        return _prepare_async(kind, fn, shape)
    if shape.keywords:
        names = ", ".join(shape.names) or "**kwargs"

        def spread(ctx: Context, payload: Any) -> Any:
            if not isinstance(payload, dict):
                raise TypeError(
                    f"task {kind!r} takes keyword arguments ({names}): its payload must be a "
                    f"JSON object, got {type(payload).__name__}"
                )
            return fn(ctx, **payload)

        return spread
    model = shape.model
    if model is not None:

        def build(ctx: Context, payload: Any) -> Any:
            return fn(ctx, model(**payload) if isinstance(payload, dict) else payload)

        return build
    return fn


def _prepare_async(kind: str, fn: Callable[..., Any], shape: _Shape) -> Callable[[Any, Any], Any]:
    """`prepare_handler` for an `async def` handler: the same shapes, awaited."""
    if shape.keywords:
        names = ", ".join(shape.names) or "**kwargs"

        async def spread(ctx: Any, payload: Any) -> Any:
            if not isinstance(payload, dict):
                raise TypeError(
                    f"task {kind!r} takes keyword arguments ({names}): its payload must be a "
                    f"JSON object, got {type(payload).__name__}"
                )
            return await fn(ctx, **payload)

        return spread
    model = shape.model
    if model is not None:

        async def build(ctx: Any, payload: Any) -> Any:
            return await fn(ctx, model(**payload) if isinstance(payload, dict) else payload)

        return build
    if inspect.iscoroutinefunction(fn):
        return fn

    async def call(ctx: Any, payload: Any) -> Any:
        # A callable object with an async __call__, or a decorator's plain wrapper of an async
        # def (it returns the coroutine): awaited when what it returns is awaitable.
        returned = fn(ctx, payload)
        return await returned if inspect.isawaitable(returned) else returned

    return call


def _payload(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The payload stored for `handle.enqueue(conn, *args, **kwargs)`: the arguments bound to the
    handler's parameters after ctx (a TypeError names a wrong one, as a call would)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return args[0] if args else None
    params = list(sig.parameters.values())[1:]
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        names = [p.name for p in params if p.kind is not p.VAR_POSITIONAL]
        for key in kwargs:
            if key not in names:  # named before a missing one: the typo is what went wrong
                raise unexpected_keyword(f"{getattr(fn, '__name__', 'task')}.enqueue():", key, names)
    try:
        bound = sig.bind(None, *args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{getattr(fn, '__name__', 'task')}.enqueue(): {exc}") from None
    if _shape(fn).keywords:
        return dict(kwargs)
    names = list(sig.parameters)[1:]
    value = bound.arguments.get(names[0]) if names else None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


class TaskRun(Enqueued, Generic[R]):
    """What a task's `.enqueue_run(conn, ...)` returns: an Enqueued whose `wait()` is typed with
    the handler's result type (an `async def` handler's: what its coroutine returns), so mypy
    sees `report.enqueue_run(conn, week=48).wait(timeout=5)` as the handler's return type. The
    value is the stored result as JSON reads it back (a tuple comes back a list, a dataclass a
    dict). On a psycopg AsyncConnection `wait(aconn)` is awaited."""

    @overload
    def wait(self, conn: AConn, *, timeout: float | None = None) -> Coroutine[Any, Any, R]: ...

    @overload
    def wait(self, conn: Conn | None = None, *, timeout: float | None = None) -> R: ...

    def wait(self, conn: Any = None, *, timeout: float | None = None) -> Any:
        """Enqueued.wait: the run's result once it succeeded, else its failure raised."""
        return super().wait(conn, timeout=timeout)


class AsyncTaskRun(Enqueued, Generic[R]):
    """What a task's `await .enqueue_run_async(aconn, ...)` returns: `await handle.wait()` on
    the connection it was enqueued on (or another AsyncConnection) is typed as TaskRun's is."""

    @overload
    def wait(self, conn: Conn, *, timeout: float | None = None) -> R: ...

    @overload
    def wait(
        self, conn: AConn | None = None, *, timeout: float | None = None
    ) -> Coroutine[Any, Any, R]: ...

    def wait(self, conn: Any = None, *, timeout: float | None = None) -> Any:
        """Enqueued.wait: awaited on an AsyncConnection."""
        return super().wait(conn, timeout=timeout)


def _typed(done: Enqueued, cls: type[E]) -> E:
    """`done` as a TaskRun or an AsyncTaskRun (the same fields, its connection kept)."""
    return cls(done.run_id, done.existing, done.how, done.origin)


@dataclasses.dataclass(frozen=True)
class Configured(Generic[P, R]):
    """A task's typed enqueue with options: `task.configure(key="acct-7").enqueue(conn, ...)`
    and `.enqueue_run(conn, ...)`, which returns a TaskRun typed with the task's result."""

    client: Client
    kind: str
    fn: Callable[..., Any]
    options: EnqueueOptions

    def enqueue(self, conn: Conn, /, *args: P.args, **kwargs: P.kwargs) -> int:
        payload = _payload(self.fn, args, kwargs)
        return self.client.enqueue(conn, self.kind, payload, **self.options)

    async def enqueue_async(self, conn: AConn, /, *args: P.args, **kwargs: P.kwargs) -> int:
        payload = _payload(self.fn, args, kwargs)
        return await self.client.enqueue_async(conn, self.kind, payload, **self.options)

    @overload
    def enqueue_run(
        self: Configured[P, Coroutine[Any, Any, T]], conn: Conn, /, *args: P.args, **kwargs: P.kwargs
    ) -> TaskRun[T]: ...

    @overload
    def enqueue_run(
        self: Configured[P, T], conn: Conn, /, *args: P.args, **kwargs: P.kwargs
    ) -> TaskRun[T]: ...

    def enqueue_run(self, conn: Conn, /, *args: Any, **kwargs: Any) -> Any:
        """`Client.enqueue_run` of this task: a TaskRun, whose `wait()` returns the result."""
        payload = _payload(self.fn, args, kwargs)
        return _typed(self.client.enqueue_run(conn, self.kind, payload, **self.options), TaskRun)

    @overload
    async def enqueue_run_async(
        self: Configured[P, Coroutine[Any, Any, T]],
        conn: AConn,
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> AsyncTaskRun[T]: ...

    @overload
    async def enqueue_run_async(
        self: Configured[P, T], conn: AConn, /, *args: P.args, **kwargs: P.kwargs
    ) -> AsyncTaskRun[T]: ...

    async def enqueue_run_async(self, conn: AConn, /, *args: Any, **kwargs: Any) -> Any:
        """`enqueue_run` on a psycopg AsyncConnection: `await handle.wait()`."""
        payload = _payload(self.fn, args, kwargs)
        done = await self.client.enqueue_run_async(conn, self.kind, payload, **self.options)
        return _typed(done, AsyncTaskRun)


class TaskHandle(Generic[P, R]):
    """What `@app.task(kind)` returns. Calling it calls the handler as written; `.enqueue(conn,
    ...)` enqueues a run of its kind with the handler's own arguments after ctx, so mypy checks
    them: `def send_report(ctx, *, week: int)` gives `send_report.enqueue(conn, week=48)`;
    `def send_report(ctx, payload: Report)` (a TypedDict or a dataclass) gives
    `send_report.enqueue(conn, Report(...))`."""

    def __init__(self, client: Client, kind: str, fn: Callable[Concatenate[Context, P], R]) -> None:
        self.client = client
        self.kind = kind
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", kind)
        self.__qualname__ = getattr(fn, "__qualname__", kind)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def __call__(self, ctx: Context, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(ctx, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<task {self.kind!r}: {self.__qualname__}>"

    def configure(self, **options: Unpack[EnqueueOptions]) -> Configured[P, R]:
        """The enqueue options (as `app.enqueue` takes them) for the next `.enqueue` or
        `.enqueue_run`."""
        accept_options("configure", options, EnqueueOptions)
        return Configured(self.client, self.kind, self.fn, options)

    def enqueue(self, conn: Conn, /, *args: P.args, **kwargs: P.kwargs) -> int:
        """Enqueue a run of this task inside the caller's transaction; returns its id."""
        return self.configure().enqueue(conn, *args, **kwargs)

    async def enqueue_async(self, conn: AConn, /, *args: P.args, **kwargs: P.kwargs) -> int:
        """`enqueue` on a psycopg AsyncConnection."""
        return await self.configure().enqueue_async(conn, *args, **kwargs)

    @overload
    def enqueue_run(
        self: TaskHandle[P, Coroutine[Any, Any, T]], conn: Conn, /, *args: P.args, **kwargs: P.kwargs
    ) -> TaskRun[T]: ...

    @overload
    def enqueue_run(
        self: TaskHandle[P, T], conn: Conn, /, *args: P.args, **kwargs: P.kwargs
    ) -> TaskRun[T]: ...

    def enqueue_run(self, conn: Conn, /, *args: Any, **kwargs: Any) -> Any:
        """`enqueue`, returning a TaskRun (an Enqueued): `handle.wait(timeout=5)` after the
        commit returns the run's result, typed as the handler's (docs/workflows.md,
        "Waiting for a result")."""
        return self.configure().enqueue_run(conn, *args, **kwargs)

    @overload
    async def enqueue_run_async(
        self: TaskHandle[P, Coroutine[Any, Any, T]],
        conn: AConn,
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> AsyncTaskRun[T]: ...

    @overload
    async def enqueue_run_async(
        self: TaskHandle[P, T], conn: AConn, /, *args: P.args, **kwargs: P.kwargs
    ) -> AsyncTaskRun[T]: ...

    async def enqueue_run_async(self, conn: AConn, /, *args: Any, **kwargs: Any) -> Any:
        """`enqueue_run` on a psycopg AsyncConnection: `await handle.wait(timeout=5)`."""
        return await self.configure().enqueue_run_async(conn, *args, **kwargs)
