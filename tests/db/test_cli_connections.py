"""`leasework connections add|list|sync|delete|disconnect` and `leasework schedules`, in process,
against real Postgres, with the real `files` connector and `worker --once`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from leasework import cli

from .syncing import connection_row, live, sync_app, syncs, write_jsonl

Conn = psycopg.Connection[Any]


def run(capsys: pytest.CaptureFixture[str], dsn: str, *argv: str) -> tuple[int, str, str]:
    code = cli.main([*argv, "--dsn", dsn])
    out, err = capsys.readouterr()
    return code, out, err


def test_connections_commands_end_to_end(
    conn: Conn, dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_jsonl(tmp_path, "projects", [{"id": 1}, {"id": 2}])
    code, out, err = run(
        capsys,
        dsn,
        "connections",
        "add",
        "--workspace",
        "ws",
        "--provider",
        "files",
        "--connector-config",
        orjson.dumps({"path": str(tmp_path)}).decode(),
        "--every",
        "900",
    )
    assert code == 0, err
    cid = int(out)
    assert run(capsys, dsn, "worker", "--once", "--app", "leasework.cli:builtin_app")[0] == 0
    assert live(conn, cid) == {("projects", "1"), ("projects", "2")}

    code, out, _ = run(capsys, dsn, "connections", "list")
    assert code == 0
    assert "files" in out and "900s" in out and " 2 " in out
    code, out, _ = run(capsys, dsn, "connections", "list", "--json")
    (listed,) = orjson.loads(out)
    assert listed["id"] == cid and listed["live_records"] == 2

    write_jsonl(tmp_path, "projects", [{"id": 1}])
    code, out, _ = run(capsys, dsn, "connections", "sync", str(cid))
    assert code == 0 and int(out) > 0
    run(capsys, dsn, "worker", "--once", "--app", "leasework.cli:builtin_app")
    assert live(conn, cid) == {("projects", "1")}

    code, out, _ = run(capsys, dsn, "status")
    assert code == 0 and "connections:" in out and "projects" in out

    code, out, _ = run(capsys, dsn, "connections", "delete", str(cid))
    assert code == 0 and int(out.split()[0]) > 0
    run(capsys, dsn, "worker", "--once", "--app", "leasework.cli:builtin_app")
    assert connection_row(conn, cid) is None


def test_connections_bad_input_exits_2(
    conn: Conn, dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, dsn, "connections", "add", "--workspace", "ws", "--provider", "nope")
    assert code == 2 and "unknown provider 'nope'" in err
    code, _, err = run(
        capsys, dsn, "connections", "add", "--workspace", "ws", "--provider", "files"
    )
    assert code == 2 and '"path"' in err
    code, _, err = run(capsys, dsn, "connections", "sync", "99")
    assert code == 2 and "no connection with id 99" in err
    code, _, err = run(capsys, dsn, "connections", "delete", "99")
    assert code == 2 and err.count("\n") == 1


def test_disconnect_and_schedules(
    conn: Conn, dsn: str, tmp_path: Path, make_worker: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    app = sync_app()
    cid = syncs(app).connect(
        conn, workspace="ws", provider="files", config={"path": str(tmp_path)}, sync=False
    )
    code, out, _ = run(capsys, dsn, "connections", "disconnect", str(cid))
    assert code == 0 and "disconnected" in out
    code, _, err = run(capsys, dsn, "connections", "sync", str(cid))
    assert code == 2 and "disconnected" in err

    @app.task("nightly", cron="0 2 * * *", tz="Europe/Berlin")
    def nightly(ctx: Any, payload: Any) -> None:
        return None

    @app.task("tick", every=300)
    def tick(ctx: Any, payload: Any) -> None:
        return None

    make_worker(app).poll()
    # A periodic task since removed from the code: its row stays, overdue, and is never enqueued.
    conn.execute(
        "INSERT INTO leasework.schedules (name, kind, every_seconds, next_run_at)"
        " VALUES ('gone', 'gone', 60, leasework.now() - interval '2 hours')"
    )
    code, out, _ = run(capsys, dsn, "schedules")
    assert code == 0
    lines = out.splitlines()
    assert any(line.startswith("nightly") and "0 2 * * * Europe/Berlin" in line for line in lines)
    assert any(
        line.startswith("tick") and "every 300s" in line and "succeeded" in line for line in lines
    )
    (gone,) = [line for line in lines if line.startswith("gone")]
    assert "overdue 2h00m: no running worker has this task" in gone
    assert not any("overdue" in line for line in lines if not line.startswith("gone"))
    code, out, _ = run(capsys, dsn, "schedules", "--json")
    listed = {s["name"]: s for s in orjson.loads(out)}
    assert set(listed) == {"nightly", "tick", "gone"}
    assert listed["gone"]["overdue_seconds"] >= 7200 and listed["tick"]["overdue_seconds"] == 0
