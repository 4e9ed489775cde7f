"""Fixtures for the security suite: deploy/roles.sql applied to the session's database, and login
roles made for one test (unique names: roles are cluster-wide and other suites share the server),
dropped afterwards."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

ROLES = Path(__file__).resolve().parents[2] / "deploy" / "roles.sql"


@pytest.fixture
def login(conn: psycopg.Connection[Any], dsn: str) -> Iterator[Callable[[str | None], str]]:
    """login(group) -> a DSN for a new login role in `group` (None: in no group at all)."""
    conn.execute(ROLES.read_text())
    made: list[str] = []

    def factory(group: str | None) -> str:
        name = f"lw_sec_{(group or 'nobody').removeprefix('leasework_')}_{secrets.token_hex(4)}"
        if group is None:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
        else:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                    sql.Identifier(name), sql.Identifier(group)
                )
            )
        made.append(name)
        params = conninfo_to_dict(dsn)
        params["user"] = name
        return make_conninfo(**params)

    yield factory
    for name in made:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,)
        )
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


APP_MODULE = """
from leasework import App

app = App()


@app.task("echo")
def echo(ctx, payload):
    return payload


@app.task("hostile", max_attempts=1)
def hostile(ctx, payload):
    raise RuntimeError("\\x1b]0;PWNED\\x07\\x1b[2J\\r\\nforged line")
"""


@pytest.fixture
def cli(tmp_path: Path, dsn: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """cli(*args, dsn=True, env={}) runs `python -m leasework ...` in tmp_path (its app module:
    secapp:app) with no LEASEWORK_* or PG* variable but those given."""
    (tmp_path / "secapp.py").write_text(APP_MODULE, encoding="utf-8")
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LEASEWORK_", "PG")) and k != "DATABASE_URL"
    }

    def run(
        *args: str, with_dsn: bool = True, env: dict[str, str] | None = None, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "leasework", *args]
        extra = {"LEASEWORK_DSN": dsn} if with_dsn else {}
        return subprocess.run(
            argv,
            cwd=tmp_path,
            env={**base, **extra, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run
