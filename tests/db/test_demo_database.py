"""`leasework demo` writes only into a database the user named (`--dsn`, LEASEWORK_DSN, the config
file's `dsn`). Without one it never takes the database libpq's defaults or DATABASE_URL reach (the
user's own, or a shared server's): it makes a database of its own on that server and says so, or
says why it cannot (then an embedded Postgres, tests/process/test_demo.py)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from leasework import Config
from leasework.config import load
from leasework.demo import named_dsn, open_database, own_database


def _drop(server_dsn: str, *names: str) -> None:
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        for name in names:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def users_db(server_dsn: str) -> Iterator[str]:
    """A database standing for the user's own: where libpq's defaults (or DATABASE_URL) lead."""
    name = f"lw_users_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield name
    _drop(server_dsn, name)


@pytest.fixture
def demo_name(server_dsn: str) -> Iterator[str]:
    name = f"lw_demo_{os.getpid()}_{secrets.token_hex(3)}"
    yield name
    _drop(server_dsn, name)


@pytest.fixture
def libpq_defaults(server_dsn: str, users_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """libpq's defaults lead to the user's database; no DSN is named anywhere."""
    params = conninfo_to_dict(server_dsn)
    for var in ("LEASEWORK_DSN", "LEASEWORK_CONFIG", "DATABASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PGHOST", str(params.get("host", "127.0.0.1")))
    monkeypatch.setenv("PGPORT", str(params.get("port", "5432")))
    monkeypatch.setenv("PGUSER", str(params.get("user", "postgres")))
    monkeypatch.setenv("PGDATABASE", users_db)


@pytest.mark.usefixtures("libpq_defaults")
def test_with_no_dsn_it_makes_a_database_of_its_own_and_says_so(
    demo_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    database = open_database(Config(), embedded=False, root=tmp_path, own=demo_name)
    assert conninfo_to_dict(database.dsn).get("dbname") == demo_name
    with psycopg.connect(database.dsn) as conn:
        assert conn.info.dbname == demo_name
    said = capsys.readouterr().out
    assert f"database {demo_name}" in said and "made for the demo" in said
    assert f"dropdb {demo_name}" in said
    again = open_database(Config(), embedded=False, root=tmp_path, own=demo_name)
    assert again.dsn == database.dsn
    assert "kept from an earlier demo" in capsys.readouterr().out
    assert database.embedded is None and not (tmp_path / "pg").exists()


def test_database_url_names_the_application_database_not_the_demos(
    server_dsn: str, users_db: str, demo_name: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    url = make_conninfo(server_dsn, dbname=users_db)
    monkeypatch.delenv("LEASEWORK_DSN", raising=False)
    monkeypatch.delenv("LEASEWORK_CONFIG", raising=False)
    monkeypatch.setenv("DATABASE_URL", url)
    cfg = load(env={"DATABASE_URL": url})
    assert cfg.dsn == url and named_dsn(cfg) is None
    database = open_database(cfg, embedded=False, root=tmp_path, own=demo_name)
    assert conninfo_to_dict(database.dsn).get("dbname") == demo_name
    assert demo_name in capsys.readouterr().out


def test_a_named_database_is_used_as_it_is(server_dsn: str, tmp_path: Path) -> None:
    for cfg in (
        load(env={"LEASEWORK_DSN": server_dsn}),
        load(env={}, overrides={"dsn": server_dsn}),
        Config(dsn=server_dsn),  # made in code, not from DATABASE_URL
    ):
        assert named_dsn(cfg) == server_dsn
        assert open_database(cfg, embedded=False, root=tmp_path).dsn == server_dsn


def test_a_role_that_may_not_create_a_database_is_told_why(server_dsn: str) -> None:
    role = f"lw_nocreate_{secrets.token_hex(3)}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        found = own_database(make_conninfo(server_dsn, user=role), f"lw_never_{role}")
        assert isinstance(found, str) and "cannot create database" in found, found
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
