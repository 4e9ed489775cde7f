"""Awaitable enqueue, enqueue_many and cancel on a psycopg AsyncConnection, in a real asyncio
program on real Postgres; the wrong connection type refused in one line; the Client enqueuing by
kind without handlers; the typed enqueue of a task object."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psycopg
import pytest

from leasework import (
    App,
    AsyncTaskRun,
    Client,
    ConfigError,
    Context,
    Enqueued,
    RunFailed,
    TaskRun,
    UnknownKind,
    WrongConnection,
)
from leasework.testing import drain

Conn = psycopg.Connection[Any]
ROOT = Path(__file__).resolve().parents[2]


def make_app() -> App:
    app = App()

    @app.task("report", max_attempts=7, timeout=120)
    def report(ctx: Context, payload: dict[str, Any]) -> Any:
        return payload

    return app


def runs(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT kind, payload, key, status, max_attempts, timeout_seconds FROM leasework.runs "
        "ORDER BY id"
    ).fetchall()


def test_async_enqueue_many_and_cancel_commit_and_roll_back_with_the_transaction(
    dsn: str, conn: Conn
) -> None:
    app = make_app()

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with await psycopg.AsyncConnection.connect(dsn) as aconn:
            await aconn.execute("LISTEN leasework")
            async with aconn.transaction():
                out["one"] = await app.enqueue_async(aconn, "report", {"n": 1}, key="k", tenant="t")
                out["again"] = await app.enqueue_run_async(
                    aconn, "report", {"n": 2}, key="k", tenant="t"
                )
                out["many"] = await app.enqueue_many_async(aconn, "report", [{"n": 3}, {"n": 4}])
                out["keyed"] = await app.enqueue_many_async(
                    aconn, "report", [{"n": 5}, {"n": 6}], keys=["k", "k2"], tenant="t"
                )
            try:
                async with aconn.transaction():
                    await app.enqueue_async(aconn, "report", {"n": 99})
                    raise RuntimeError("roll back")
            except RuntimeError:
                pass
            out["cancel"] = await app.cancel_async(aconn, out["one"])
            await aconn.commit()
            out["notifies"] = []
            gen = aconn.notifies(timeout=5, stop_after=1)
            async for note in gen:
                out["notifies"].append(note.payload)
        return out

    out = asyncio.run(main())
    assert out["again"].existing and out["again"].run_id == out["one"]
    assert len(out["many"]) == 2 and len(out["keyed"]) == 1  # "k" was busy in tenant "t"
    assert out["cancel"] == "cancelled"
    assert out["notifies"] == ["report"]
    assert runs(conn) == [
        ("report", {"n": 1}, "k", "cancelled", 7, 120.0),
        ("report", {"n": 3}, None, "queued", 7, 120.0),
        ("report", {"n": 4}, None, "queued", 7, 120.0),
        ("report", {"n": 6}, "k2", "queued", 7, 120.0),
    ]


def test_the_wrong_connection_type_is_one_line_and_writes_nothing(dsn: str, conn: Conn) -> None:
    app = make_app()

    async def main() -> list[str]:
        errors = []
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            for call in (
                lambda: app.enqueue(aconn, "report", {}),  # type: ignore[arg-type]
                lambda: app.enqueue_many(aconn, "report", [{}]),  # type: ignore[arg-type]
                lambda: app.cancel(aconn, 1),  # type: ignore[arg-type]
            ):
                with pytest.raises(WrongConnection) as info:
                    call()
                errors.append(str(info.value))
        return errors

    errors = asyncio.run(main())
    assert errors[0] == (
        "enqueue() got a psycopg.AsyncConnection: use `await enqueue_async(conn, ...)`, or pass "
        "a psycopg.Connection"
    )
    assert "await enqueue_many_async" in errors[1] and "await cancel_async" in errors[2]
    with pytest.raises(
        WrongConnection,
        match=r"^enqueue_async\(\) got a psycopg.Connection \(not async\): call enqueue\(conn, \.\.\.\) without await",
    ):
        asyncio.run(app.enqueue_async(conn, "report", {}))  # type: ignore[arg-type]
    with pytest.raises(WrongConnection, match=r"^cancel_async\(\) got a psycopg.Connection"):
        asyncio.run(app.cancel_async(conn, 1))  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"^enqueue\(\) needs a psycopg.Connection, got builtins.str"
    ):
        app.enqueue("postgresql://", "report", {})  # type: ignore[arg-type]
    assert all("\n" not in e for e in errors)
    assert runs(conn) == []


def test_a_client_enqueues_by_kind_without_handlers(dsn: str, conn: Conn) -> None:
    client = Client()
    run_id = client.enqueue(conn, "report", {"n": 1}, key="c1")
    assert client.enqueue(conn, "report", {"n": 2}, key="c1") == run_id
    ids = client.enqueue_many(conn, "report", [{"n": 3}], max_attempts=2)

    async def main() -> int:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            return await client.enqueue_async(aconn, "report", {"n": 4})

    asyncio.run(main())
    # the Client's runs carry the defaults, not the task's settings (README)
    assert runs(conn) == [
        ("report", {"n": 1}, "c1", "queued", 3, 3600.0),
        ("report", {"n": 3}, None, "queued", 2, 3600.0),
        ("report", {"n": 4}, None, "queued", 3, 3600.0),
    ]
    # a worker that has the handler runs them
    ran = drain(make_app(), conn)
    assert [r.result for r in ran] == [{"n": 1}, {"n": 3}, {"n": 4}]
    assert ids == [ran[1].run_id]
    # the form of a kind is still checked; the app alone refuses kinds it lacks
    with pytest.raises(Exception, match="kind 'bad kind' is not valid"):
        client.enqueue(conn, "bad kind")
    with pytest.raises(UnknownKind, match="unknown kind 'reprot'; known kinds: report"):
        make_app().enqueue(conn, "reprot")


def test_a_client_told_a_kinds_settings_gives_them_to_its_runs(conn: Conn) -> None:
    from leasework import KindDefaults

    client = Client(kinds={"report": KindDefaults(max_attempts=5, timeout=2.0)})
    client.enqueue(conn, "report", {"n": 1})
    client.enqueue_many(conn, "report", [{"n": 2}])
    client.enqueue(conn, "other", {"n": 3})  # not told: the defaults
    assert runs(conn) == [
        ("report", {"n": 1}, None, "queued", 5, 2.0),
        ("report", {"n": 2}, None, "queued", 5, 2.0),
        ("other", {"n": 3}, None, "queued", 3, 3600.0),
    ]
    with pytest.raises(ConfigError, match=r"kinds\['report'\] must be a KindDefaults"):
        Client(kinds={"report": {"max_attempts": 5}})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="timeout"):
        Client(kinds={"report": KindDefaults(timeout=-1)})


@dataclasses.dataclass
class Invoice:
    invoice: int
    lines: list[str]


def test_typed_enqueue_from_the_task_object(dsn: str, conn: Conn) -> None:
    app = App()
    seen: list[Any] = []

    @app.task("send_report")
    def send_report(ctx: Context, *, week: int, final: bool = False) -> int:
        seen.append((week, final))
        return week

    @app.task("send_invoice")
    def send_invoice(ctx: Context, payload: Invoice) -> int:
        seen.append(payload)
        return payload.invoice

    a = send_report.enqueue(conn, week=48)
    b = send_report.configure(key="w49", priority=5).enqueue(conn, week=49, final=True)
    c = send_invoice.enqueue(conn, Invoice(7, ["x"]))

    async def main() -> int:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            return await send_report.enqueue_async(aconn, week=50)

    d = asyncio.run(main())
    rows = conn.execute(
        "SELECT id, payload, key, priority FROM leasework.runs ORDER BY id"
    ).fetchall()
    assert rows == [
        (a, {"week": 48}, None, 0),
        (b, {"week": 49, "final": True}, "w49", 5),
        (c, {"invoice": 7, "lines": ["x"]}, None, 0),
        (d, {"week": 50}, None, 0),
    ]
    ran = drain(app, conn)
    assert [r.result for r in ran] == [48, 7, 50, 49]  # priority 5 last: lower runs first
    assert Invoice(7, ["x"]) in seen and (48, False) in seen
    # still callable as written, and a wrong argument is refused before anything is written
    assert send_report(None, week=1) == 1  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword argument 'wek'"):
        send_report.enqueue(conn, week=1, wek=48)  # type: ignore[call-arg]
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (4,)


def test_a_tasks_enqueue_run_returns_a_handle_that_waits_for_its_result(
    dsn: str, conn: Conn
) -> None:
    """`task.enqueue_run(conn, ...)` and `await task.enqueue_run_async(aconn, ...)` (also after
    `.configure(...)`): an Enqueued (a TaskRun) whose `wait()` returns the result, on the
    connection it was enqueued on; the key's run returned says so, as app.enqueue_run does."""
    app = App()

    @app.task("double")
    def double(ctx: Context, *, n: int) -> dict[str, int]:
        return {"n": 2 * n}

    @app.task("fails", max_attempts=1)
    def fails(ctx: Context, payload: Any) -> None:
        raise RuntimeError("no")

    handle = double.enqueue_run(conn, n=21)
    assert isinstance(handle, TaskRun) and isinstance(handle, Enqueued)
    keyed = double.configure(key="k", priority=-1).enqueue_run(conn, n=1)
    again = double.configure(key="k").enqueue_run(conn, n=2)
    assert (again.run_id, again.existing, again.how) == (keyed.run_id, True, "active")
    failing = fails.enqueue_run(conn, {})
    drain(app, conn)
    assert handle.wait(timeout=5) == {"n": 42}
    assert keyed.wait(conn, timeout=5) == {"n": 2}
    with pytest.raises(RunFailed, match="no"):
        failing.wait(timeout=5)

    async def main() -> Any:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            ahandle = await double.configure(tenant="t").enqueue_run_async(aconn, n=5)
            assert isinstance(ahandle, AsyncTaskRun)
            await asyncio.to_thread(drain, app, dsn)
            return ahandle.run_id, await ahandle.wait(timeout=5)

    run_id, result = asyncio.run(main())
    assert result == {"n": 10}
    assert conn.execute("SELECT tenant FROM leasework.runs WHERE id = %s", (run_id,)).fetchone() == (
        "t",
    )


def test_mypy_checks_the_typed_enqueue(tmp_path: Path) -> None:
    snippet = tmp_path / "snippet.py"
    snippet.write_text(
        textwrap.dedent(
            """
            from typing import Any, TypedDict

            import psycopg

            from leasework import App, Context

            app = App()


            class Invoice(TypedDict):
                invoice: int


            @app.task("send_report")
            def send_report(ctx: Context, *, week: int) -> None: ...


            @app.task("send_invoice")
            def send_invoice(ctx: Context, payload: Invoice) -> None: ...


            def good(conn: psycopg.Connection[Any]) -> None:
                send_report.enqueue(conn, week=48)
                send_report.configure(key="k").enqueue(conn, week=48)
                send_invoice.enqueue(conn, {"invoice": 7})
                app.enqueue(conn, "send_report", {"week": 48})


            def bad(conn: psycopg.Connection[Any]) -> None:
                send_report.enqueue(conn, wek=48)  # line 30
                send_report.enqueue(conn, week="48")  # line 31
                send_invoice.enqueue(conn, {"invoise": 7})  # line 32


            @app.task("double")
            def double(ctx: Context, *, n: int) -> dict[str, int]: return {"n": n}


            @app.task("adouble")
            async def adouble(ctx: Context, *, n: int) -> int: return n


            def results(conn: psycopg.Connection[Any]) -> None:
                a: dict[str, int] = double.enqueue_run(conn, n=1).wait(timeout=5)
                b: dict[str, int] = double.configure(priority=1).enqueue_run(conn, n=1).wait()
                c: int = adouble.enqueue_run(conn, n=1).wait()
                d: str = double.enqueue_run(conn, n=1).wait()  # line 47
                e: str = adouble.enqueue_run(conn, n=1).wait()  # line 48
                double.enqueue_run(conn, m=1)  # line 49


            async def aresults(aconn: psycopg.AsyncConnection[Any]) -> None:
                a: dict[str, int] = await (await double.enqueue_run_async(aconn, n=1)).wait()
                b: int = await (await adouble.enqueue_run_async(aconn, n=1)).wait(timeout=1)
                c: dict[str, int] = await double.enqueue_run(aconn, n=1).wait()  # line 55
                d: str = await (await adouble.enqueue_run_async(aconn, n=1)).wait()  # line 56


            def policies(conn: psycopg.Connection[Any]) -> None:
                from leasework import After

                handle = double.enqueue_run(conn, n=1)
                send_report.configure(after=[1, handle, After(2, "run"), After(handle, "cancel")])
                wf = app.workflow()
                node = wf.add("double", {}, after=After(3, on_failure="run"))
                wf.add("double", {}, after=[node, After(node, "run")])
                send_report.configure(after=[After(2, "maybe")])  # line 67
            """
        ).lstrip("\n")
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / "c"),
            str(snippet),
        ],
        env={"MYPYPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    lines = sorted({int(line.split(":")[1]) for line in errors})
    assert lines == [30, 31, 32, 47, 48, 49, 55, 56, 67], done.stdout + done.stderr
    assert any('Unexpected keyword argument "wek"' in e for e in errors)
