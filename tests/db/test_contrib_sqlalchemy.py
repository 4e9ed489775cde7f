"""leasework.contrib.sqlalchemy on real SQLAlchemy 2 (sync and asyncio, psycopg driver) and real
Postgres: the run is written in the ORM's transaction, so it commits and rolls back with the
ORM's own rows; anything but a psycopg-driven Session or Connection is refused in one line."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from leasework import App
from leasework.contrib import sqlalchemy as lw_sa
from leasework.errors import UnknownKind

Conn = psycopg.Connection[Any]


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "sa_orders"
    __table_args__ = {"schema": "public"}
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str]


def make_app() -> App:
    app = App()
    app.task("ship")(lambda ctx, p: None)
    return app


@pytest.fixture
def engine(dsn: str, conn: Conn) -> Iterator[Engine]:
    eng = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))
    Base.metadata.drop_all(eng)
    Base.metadata.create_all(eng)
    yield eng
    eng.dispose()


def runs(conn: Conn) -> list[tuple[str, Any]]:
    return [
        (r[0], r[1]) for r in conn.execute("SELECT kind, payload FROM leasework.runs ORDER BY id")
    ]


def orders(conn: Conn) -> list[str]:
    return [r[0] for r in conn.execute("SELECT item FROM public.sa_orders ORDER BY id")]


def test_the_run_commits_with_the_session(engine: Engine, conn: Conn) -> None:
    app = make_app()
    with Session(engine) as session:
        session.add(Order(id=1, item="book"))
        session.flush()
        run_id = lw_sa.enqueue(app, session, "ship", {"order": 1})
        assert runs(conn) == []  # not visible before the ORM commits
        session.commit()
    assert runs(conn) == [("ship", {"order": 1})] and orders(conn) == ["book"]
    assert conn.execute(
        "SELECT status FROM leasework.runs WHERE id = %s", (run_id,)
    ).fetchone() == ("queued",)


def test_the_run_rolls_back_with_the_session(engine: Engine, conn: Conn) -> None:
    app = make_app()
    with Session(engine) as session:
        session.add(Order(id=2, item="lamp"))
        lw_sa.enqueue(app, session, "ship", {"order": 2})
        lw_sa.enqueue_many(app, session, "ship", [{"order": 3}, {"order": 4}])
        session.rollback()
    assert runs(conn) == [] and orders(conn) == []


def test_a_connection_in_a_begin_block(engine: Engine, conn: Conn) -> None:
    app = make_app()
    with pytest.raises(RuntimeError, match="boom"), engine.begin() as c:
        c.execute(text("INSERT INTO public.sa_orders (id, item) VALUES (5, 'pen')"))
        lw_sa.enqueue(app, c, "ship", {"order": 5})
        raise RuntimeError("boom")
    assert runs(conn) == [] and orders(conn) == []
    with engine.begin() as c:
        lw_sa.enqueue(app, c, "ship", {"order": 6})
    with engine.connect() as c:  # no transaction yet: the enqueue begins SQLAlchemy's own
        lw_sa.enqueue(app, c, "ship", {"order": 7})
        c.commit()
    with engine.connect() as c:
        lw_sa.enqueue(app, c, "ship", {"order": 8})  # closed without commit: rolled back
    assert runs(conn) == [("ship", {"order": 6}), ("ship", {"order": 7})]


def test_asyncio_session_commits_and_rolls_back(dsn: str, conn: Conn, engine: Engine) -> None:
    app = make_app()

    async def main() -> int:
        aengine = create_async_engine(
            "postgresql+psycopg://", async_creator=lambda: psycopg.AsyncConnection.connect(dsn)
        )
        try:
            async with AsyncSession(aengine) as session:
                session.add(Order(id=7, item="cup"))
                await lw_sa.enqueue_async(app, session, "ship", {"order": 7}, key="order-7")
                await session.rollback()
            async with AsyncSession(aengine) as session, session.begin():
                session.add(Order(id=8, item="mug"))
                run_id = await lw_sa.enqueue_async(app, session, "ship", {"order": 8}, key="o-8")
                # The key rule holds on this path too: a second enqueue returns the same run.
                again = await lw_sa.enqueue_async(app, session, "ship", {"order": 8}, key="o-8")
                assert again == run_id
            async with aengine.connect() as aconn:  # an AsyncConnection works as well
                await lw_sa.enqueue_async(app, aconn, "ship", {"order": 9})
                await aconn.commit()
            return run_id
        finally:
            await aengine.dispose()

    run_id = asyncio.run(main())
    assert runs(conn) == [("ship", {"order": 8}), ("ship", {"order": 9})]
    assert orders(conn) == ["mug"]
    assert conn.execute("SELECT key FROM leasework.runs WHERE id = %s", (run_id,)).fetchone() == (
        "o-8",
    )


def test_windows_and_debounce_in_the_orms_transaction(dsn: str, conn: Conn, engine: Engine) -> None:
    """The enqueue options pass through, sync and asyncio: a debounce_merge reads and merges the
    pending run in the session's transaction (and rolls back with it); a unique window's run is
    returned by a second enqueue."""
    app = make_app()

    def union(old: Any, new: Any) -> Any:
        return {"items": sorted(set(old["items"]) | set(new["items"]))}

    with Session(engine) as session:
        first = lw_sa.enqueue(app, session, "ship", {"items": [1]}, key="doc", debounce=60)
        again = lw_sa.enqueue(
            app, session, "ship", {"items": [2]}, key="doc", debounce=60, debounce_merge=union
        )
        assert again == first
        session.commit()
    with Session(engine) as session:
        lw_sa.enqueue(
            app, session, "ship", {"items": [3]}, key="doc", debounce=60, debounce_merge=union
        )
        session.rollback()
    assert runs(conn) == [("ship", {"items": [1, 2]})]

    async def main() -> list[int]:
        aengine = create_async_engine(
            "postgresql+psycopg://", async_creator=lambda: psycopg.AsyncConnection.connect(dsn)
        )
        try:
            async with AsyncSession(aengine) as session, session.begin():
                one = await lw_sa.enqueue_async(app, session, "ship", {}, key="acct", unique_for=60)
                two = await lw_sa.enqueue_async(app, session, "ship", {}, key="acct", unique_for=60)
                made = await lw_sa.enqueue_many_async(
                    app, session, "ship", [{}, {}], keys=["acct", "b"], unique_for=60
                )
            return [one, two, *made]
        finally:
            await aengine.dispose()

    one, two, *made = asyncio.run(main())
    assert one == two and len(made) == 1 and made[0] != one


def test_wrong_session_types_are_refused_in_one_line(dsn: str, conn: Conn, engine: Engine) -> None:
    app = make_app()
    with psycopg.connect(dsn) as raw, pytest.raises(TypeError) as exc:
        lw_sa.enqueue(app, raw, "ship", {})  # type: ignore[arg-type]
    assert str(exc.value) == (
        "enqueue needs a SQLAlchemy Session or Connection on the psycopg driver "
        "(postgresql+psycopg://), got psycopg.Connection"
    )
    sqlite = create_engine("sqlite://")
    with Session(sqlite) as session, pytest.raises(TypeError, match="got one on sqlite\\+pysqlite"):
        lw_sa.enqueue(app, session, "ship", {})
    with Session(engine) as session, pytest.raises(TypeError, match="AsyncSession or AsyncConn"):
        asyncio.run(lw_sa.enqueue_async(app, session, "ship", {}))  # type: ignore[arg-type]
    with Session(engine) as session:
        with pytest.raises(UnknownKind, match="unknown kind 'shipp'"):
            lw_sa.enqueue(app, session, "shipp", {})
        session.commit()
    assert runs(conn) == []
    assert "\n" not in str(exc.value)
