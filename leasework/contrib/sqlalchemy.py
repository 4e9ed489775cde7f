"""Enqueue inside a SQLAlchemy 2 transaction (the `sqlalchemy` extra: README "Installing"): pass the
Session or Connection (sync or asyncio) on the psycopg driver (`postgresql+psycopg://`); the run
is written on the ORM's own connection, in its open transaction, so it commits and rolls back
with it. Anything else is refused in one line before anything is written."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import psycopg
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from ..client import Client

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
    app: Client, session: Session | Connection, kind: str, payload: Any = None, **options: Any
) -> int:
    """App.enqueue in the ORM's transaction: the run commits or rolls back with `session`.
    Takes App.enqueue's options (key, tenant, group, exclusive, priority, delay, max_attempts,
    unique_for, debounce, debounce_max, debounce_merge)."""
    return app.enqueue(connection(session, via="enqueue"), kind, payload, **options)


def enqueue_many(
    app: Client, session: Session | Connection, kind: str, payloads: Iterable[Any], **options: Any
) -> list[int]:
    """App.enqueue_many in the ORM's transaction."""
    return app.enqueue_many(connection(session, via="enqueue_many"), kind, payloads, **options)


async def enqueue_async(
    app: Client,
    session: AsyncSession | AsyncConnection,
    kind: str,
    payload: Any = None,
    **options: Any,
) -> int:
    """App.enqueue_async in an asyncio session's transaction: the same checks and the same SQL
    function (leasework.enqueue: key rule, NOTIFY at commit) as the sync path."""
    aconn = await async_connection(session, via="enqueue_async")
    return await app.enqueue_async(aconn, kind, payload, **options)


async def enqueue_many_async(
    app: Client,
    session: AsyncSession | AsyncConnection,
    kind: str,
    payloads: Iterable[Any],
    **options: Any,
) -> list[int]:
    """App.enqueue_many_async in an asyncio session's transaction."""
    aconn = await async_connection(session, via="enqueue_many_async")
    return await app.enqueue_many_async(aconn, kind, payloads, **options)
