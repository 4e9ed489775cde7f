"""Enqueue inside a SQLAlchemy 2 transaction (`pip install leasework[sqlalchemy]`): pass the
Session or Connection (sync or asyncio) on the psycopg driver (`postgresql+psycopg://`); the run
is written on the ORM's own connection, in its open transaction, so it commits and rolls back
with it. Anything else is refused in one line before anything is written."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from ..app import App
from ..errors import LeaseworkError, UnknownKind
from ..queries import load
from ..tasks import check_attempts, check_bool, check_label, check_priority, check_seconds

Q = load("leasework", "runs.sql")
SYNC = "a SQLAlchemy Session or Connection"
ASYNC = "a SQLAlchemy AsyncSession or AsyncConnection"


def _refuse(what: str, got: object, via: str) -> TypeError:
    return TypeError(
        f"{via} needs {what} on the psycopg driver (postgresql+psycopg://), got {_name(got)}"
    )


def _name(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _driver(dialect: Any, raw: Any, what: str, via: str, want: type) -> Any:
    """The psycopg connection under SQLAlchemy's, or one line saying which driver it is."""
    if dialect.name != "postgresql" or not isinstance(raw, want):
        engine = f"{dialect.name}+{dialect.driver}"
        raise TypeError(
            f"{via} needs {what} on the psycopg driver (postgresql+psycopg://), got one on {engine}"
        )
    return raw


def connection(
    session: Session | Connection, *, via: str = "connection"
) -> psycopg.Connection[Any]:
    """The psycopg connection of `session` (a Session, which begins its transaction if it has
    none, or a Connection), in the ORM's transaction. Raises TypeError for anything else."""
    if isinstance(session, Session):
        conn = session.connection()
    elif isinstance(session, Connection):
        conn = session
        if not conn.in_transaction():
            conn.begin()  # SQLAlchemy's autobegin, as its own execute() would: commit() then counts
    else:
        raise _refuse(SYNC, session, via)
    raw = conn.connection.driver_connection
    found: psycopg.Connection[Any] = _driver(conn.dialect, raw, SYNC, via, psycopg.Connection)
    return found


async def async_connection(
    session: AsyncSession | AsyncConnection, *, via: str = "async_connection"
) -> psycopg.AsyncConnection[Any]:
    """The psycopg AsyncConnection of an AsyncSession (its transaction begun) or AsyncConnection."""
    if isinstance(session, AsyncSession):
        conn = await session.connection()
    elif isinstance(session, AsyncConnection):
        conn = session
        if not conn.in_transaction():
            await conn.begin()  # autobegin, as with a sync Connection
    else:
        raise _refuse(ASYNC, session, via)
    raw = (await conn.get_raw_connection()).driver_connection
    found: psycopg.AsyncConnection[Any] = _driver(
        conn.dialect, raw, ASYNC, via, psycopg.AsyncConnection
    )
    return found


def enqueue(
    app: App, session: Session | Connection, kind: str, payload: Any = None, **options: Any
) -> int:
    """App.enqueue in the ORM's transaction: the run commits or rolls back with `session`.
    Takes App.enqueue's options (key, tenant, group, exclusive, priority, delay, max_attempts)."""
    return app.enqueue(connection(session, via="enqueue"), kind, payload, **options)


def enqueue_many(
    app: App, session: Session | Connection, kind: str, payloads: Iterable[Any], **options: Any
) -> list[int]:
    """App.enqueue_many in the ORM's transaction."""
    return app.enqueue_many(connection(session, via="enqueue_many"), kind, payloads, **options)


async def enqueue_async(
    app: App,
    session: AsyncSession | AsyncConnection,
    kind: str,
    payload: Any = None,
    *,
    key: str | None = None,
    tenant: str | None = None,
    group: str | None = None,
    exclusive: bool = False,
    priority: int = 0,
    delay: float = 0.0,
    max_attempts: int | None = None,
) -> int:
    """App.enqueue, awaited, in an asyncio session's transaction. The same checks, then the same
    SQL function (leasework.enqueue: key rule, NOTIFY at commit) as the sync path."""
    if kind not in app.tasks:
        raise UnknownKind(app._unknown(kind))
    task = app.tasks[kind]
    body = payload if payload is not None else {}
    params = {
        "kind": kind,
        "key": check_label("key", key),
        "tenant": check_label("tenant", tenant),
        "group": check_label("group", group),
        "exclusive": check_bool("exclusive", exclusive),
        "priority": check_priority(priority),
        "payload": Jsonb(body, dumps=app._dumps),
        "max_attempts": check_attempts(max_attempts)
        or task.max_attempts
        or app.config.max_attempts,
        "lease": task.lease,
        "timeout": task.timeout,
        "delay": check_seconds("delay", delay, allow_zero=True) or 0.0,
    }
    app._dumps(body)  # refuse before touching the database
    aconn = await async_connection(session, via="enqueue_async")
    cur = await aconn.execute(Q["enqueue_run"], params)
    row = await cur.fetchone()
    if row is None or row[0] is None:
        raise LeaseworkError("enqueue inserted nothing")
    return int(row[0])
