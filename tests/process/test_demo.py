"""`leasework demo` end to end on its own database: a real supervisor with 4 children, the
connection, the tasks (retried, cancelled, kill -9 and resumed) and the documents; exit 0 with
the summary table. About 15 s. And the embedded Postgres it falls back to, started and removed."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from leasework import Config
from leasework.demo import open_database

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def demo_dsn(server_dsn: str) -> Iterator[str]:
    name = f"leasework_demo_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = conninfo_to_dict(server_dsn)
    params["dbname"] = name
    yield make_conninfo(**params)
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def test_demo_runs_the_whole_story(demo_dsn: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEWORK_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "leasework", "demo", "--dsn", demo_dsn],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "every outcome as expected" in out
    assert "records: 4 live, 2 tombstoned" in out
    assert "demo.flaky: succeeded on attempt 2" in out
    assert "demo.slow: cancelled" in out
    # its line's numbers agree: the steps done are those of its partial result
    slow = re.search(r"demo\.slow: cancelled after (\d+) of 200 steps .*\{\"done\":(\d+)\}", out)
    assert slow is not None and slow.group(1) == slow.group(2), out
    assert "['crashed', 'succeeded']" in out and "kill -9" in out
    assert "8/8 files ready" in out
    assert "Summary" in out and "total" in out
    assert not (tmp_path / ".leasework" / "pg").exists()
    with psycopg.connect(demo_dsn) as conn:
        left = conn.execute(
            "SELECT count(*) FROM leasework.workers WHERE stopped_at IS NULL"
        ).fetchone()
        assert left == (0,), "the demo's supervisor stopped its workers on the way out"
        statuses = dict(
            conn.execute("SELECT status, count(*) FROM leasework.runs GROUP BY status").fetchall()
        )
        assert set(statuses) == {"succeeded", "cancelled"}, statuses


def test_embedded_postgres_is_started_and_removed() -> None:
    pytest.importorskip("pgserver")
    # Not under pytest's tmp_path: run as root, the server runs as another user, which must
    # traverse the directory's parents, and every pytest session on the machine resets
    # /tmp/pytest-of-root to 0700 when it starts (another session did, and the server could not
    # start).
    with tempfile.TemporaryDirectory(prefix="leasework-embedded-") as tmp:
        root = Path(tmp)
        database = open_database(Config(), embedded=True, root=root)
        try:
            with psycopg.connect(database.dsn) as conn:
                assert conn.execute("SELECT 1").fetchone() == (1,)
        finally:
            database.close()
        assert not (root / "pg").exists()
